"""The suite within its budget (`.ci/run` on a clean clone in at most 1800 s on 2 cores): every test that
takes over 60 s says why in its docstring, so that its cost is a decision a reader can check.

SLOW names them, from the durations `make test` prints (`--durations=30`; docs/contributing.md says what
to try before a test joins it). A test that grows past 60 s joins the list with its reason; one that is
renamed or removed must leave it (the check below fails on a name that no longer exists). Durations are not
asserted here: on a shared machine they vary twofold, and a test that fails for its neighbours' load is worse
than none.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
SLOW = [
    "e2e/test_bench_pipeline.py::test_inprocess_beside_sync_on_the_tiny_model",
    "e2e/test_chaos.py::test_random_kills_of_every_service_and_redis_lose_nothing",
    "e2e/test_docs_pages.py::test_every_block_of_the_page_runs_as_written",
    "e2e/test_bench_staleness.py::test_quick_study_trains_every_run_at_exactly_its_staleness_and_resumes",
    "e2e/test_chaos.py::test_continuous_generators_killed_or_stopped_lose_at_most_their_unsaved_tokens",
    "e2e/test_chaos.py::test_continuous_generators_on_staggered_versions_with_engines_out_of_process_lose_nothing",
    "e2e/test_chaos.py::test_reward_replicas_judging_with_a_language_model_killed_mid_call_lose_nothing",
    "e2e/test_configs.py::test_the_config_starts_in_its_real_shape_and_trains_with_a_clean_audit",
    "e2e/test_stalls.py::test_each_frozen_service_is_named_within_the_bound_and_the_run_recovers",
    "e2e/test_up.py::test_sigint_stops_everything_and_leaves_a_resumable_checkpoint",
    "e2e/test_up_vllm.py::test_up_with_the_vllm_generator_trains_with_a_clean_audit",
    "e2e/test_up_vllm.py::test_a_generator_whose_engine_cannot_start_is_named_in_the_stall_with_why",
    "e2e/test_gpu_smoke.py::test_the_cpu_form_passes_and_says_what_it_skipped",
]
# "Over 60 s" and then the reason: what the test waits for that cannot be shorter.
SAYS_WHY = re.compile(r"over 60 s\b\W+\w[^.]{15,}", re.IGNORECASE)


def docstring(node_id: str) -> str | None:
    """The docstring of the test function `node_id` names (`path::function`, relative to tests/)."""
    path, name = node_id.split("::")
    tree = ast.parse((TESTS / path).read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{node_id}: no such test; take it out of SLOW (or fix its name there)"
    return ast.get_docstring(found[0])


@pytest.mark.parametrize("node_id", SLOW)
def test_each_slow_test_says_why_in_its_docstring(node_id):
    doc = docstring(node_id) or ""
    assert SAYS_WHY.search(" ".join(doc.split())), (
        f"{node_id} takes over 60 s: its docstring must say so and why (`Over 60 s because ...`), or the "
        "test must get shorter (a shared fixture, fewer steps) and leave SLOW")
