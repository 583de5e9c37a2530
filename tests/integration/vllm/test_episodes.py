"""Episodes on the vLLM backend (its CPU build here): the bookkeeping and failure tests of
`tests/unit/envs/test_episodes.py`, run on a real engine: the ids trained on are the ids vLLM sampled, turn
after turn, and a failing environment ends only its episodes."""

from __future__ import annotations

import pytest

from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.version import PolicyVersion
from tests.integration.vllm.helpers import vllm_config
from tests.unit.envs import scripted
from tests.unit.envs import test_episodes as on_hf

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = vllm_config(tmp_path_factory.mktemp("vllm-cache"))
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 3))
    yield cfg, tokenizer, backend
    backend.close()


def test_trained_ids_are_the_sampled_ids_across_turns(tiny):
    on_hf.test_trained_ids_are_the_sampled_ids_across_turns(tiny)


@pytest.mark.parametrize("env_cls, reason", [(scripted.Raises, "error: step raised RuntimeError"),
                                             (scripted.Garbage, "malformed: step returned dict")])
def test_a_failing_environment_ends_only_its_own_episode(tiny, env_cls, reason):
    on_hf.test_a_failing_environment_ends_only_its_own_episode(tiny, env_cls, reason)
