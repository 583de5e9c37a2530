"""The judge's engine on vLLM (its CPU build here; one engine for the module, the tiny model in fp32), built
the way a judge scorer builds it (`judge_backend` from the judge's own config): its replies, the first
token's alternatives (those both list) and the greedy text, are transformers' on the same weights."""

from __future__ import annotations

import pytest

from asyncrlhf.config import JudgeConfig
from asyncrlhf.models import load_tokenizer
from asyncrlhf.rewards.judge import Judge
from asyncrlhf.rewards.judge.engine import LocalEngine, judge_backend
from tests.integration.vllm.helpers import PARITY_ATOL

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
TEMPLATE = "Answer: {{ completion }}\nGood?"


def judge_config(backend: str, cache_dir) -> JudgeConfig:
    return JudgeConfig(template=TEMPLATE, reply="number", max_new_tokens=6,
                       model={"name_or_path": "tiny", "tiny": {"heads": 2}, "cache_dir": str(cache_dir)},
                       engine={"backend": backend, "device": "cpu", "fallback_to_hf": False,
                               "max_model_len": 256})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    made = {}
    for backend in ("vllm", "hf"):
        cfg = judge_config(backend, cache)
        tokenizer = load_tokenizer(cfg.model)
        built, name = judge_backend(cfg, tokenizer, seed=0)
        assert name == backend
        made[backend] = LocalEngine(built, tokenizer, cfg, name)
    yield made
    made["vllm"].close()


def test_the_judges_vllm_engine_answers_as_transformers_does(engines):
    prompts = [Judge(engines["hf"].cfg, engines["hf"]).template.render(prompt="p", completion=c, reference="")
               for c in ("great stuff", "no", "a much longer answer that goes on")]
    vllm_top, hf_top = (engines[b].ask(prompts, logprob=True) for b in ("vllm", "hf"))
    for ours, theirs in zip(vllm_top, hf_top, strict=True):
        # The random model's next-token distribution is nearly flat, so which of its near-ties make a top 20
        # differs between backends; an alternative both list has one log-prob. Bytes >= 0x80 decode alone to
        # U+FFFD, several tokens summed into one text: each side sums those of its own top 20.
        shared = (set(ours.top) & set(theirs.top)) - {"\ufffd"}
        assert len(shared) >= 8
        assert max(abs(ours.top[t] - theirs.top[t]) for t in shared) <= PARITY_ATOL
    vllm_text, hf_text = (engines[b].ask(prompts, logprob=False) for b in ("vllm", "hf"))
    assert [r.text for r in vllm_text] == [r.text for r in hf_text]
