"""The pages a newcomer follows, and each algorithm's (its keys loaded, its hand-computed example run), run as
written (tools/doc_blocks.py): every shell and Python block in order, every file they save, every config
fragment loaded against the config tree, on the tiny CPU-scale configs.
A block that needs a GPU, a network or minutes says so on the page (`<!-- docs-test: skip (why) -->`). The
recipe pages' `asyncrlhf plan` reads their hub models' config.json from an offline cache holding the real
ones (tests/offline_hub.py: save_hub_configs), as the hub serves them."""

from pathlib import Path

import pytest

from tests.offline_hub import environment, save_hub_configs
from tools.doc_blocks import parse, run_page

pytestmark = pytest.mark.e2e
DOCS = Path(__file__).resolve().parents[2] / "docs"
ALGORITHMS = ["online-dpo", "ppo", "rloo", "grpo", "reinforce-pp", "best-of-n", "sft", "reward-modelling"]
PAGES = ["installation.md", "quickstart.md", "bring-your-own.md", "recipes/tldr.md", "recipes/alpacafarm.md",
         "recipes/gsm8k.md", *(f"algorithms/{name}.md" for name in ALGORITHMS)]


@pytest.fixture(scope="module")
def hub_configs(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("hf")
    save_hub_configs(home)
    return environment(home)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs_as_written(tmp_path, page, hub_configs, monkeypatch):
    """Over 60 s for the pages whose blocks run `asyncrlhf up` as a reader does (quickstart, bring-your-own:
    a whole run each, then its audit and what the page does with it)."""
    if page.startswith("recipes/"):
        for key, value in hub_configs.items():
            monkeypatch.setenv(key, value)
    failed = run_page(DOCS / page, tmp_path)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_more_than_it_skips(page):
    blocks = parse((DOCS / page).read_text())
    ran = [b for b in blocks if b.action == "run"]
    assert ran, f"{page}: no block runs"
    assert all(b.skip.strip() for b in blocks if b.skip), f"{page}: a skip without its reason"
