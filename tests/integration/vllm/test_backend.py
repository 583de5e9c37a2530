"""The vLLM backend on a real engine (vLLM's CPU build here): generation seeded by torch's RNG, log-prob and
`score_tokens` parity with the HF backend, full-weight pushes through the real WeightSync gRPC path, and a
refused push. One engine for the module (eager: it starts in tens of seconds on CPU)."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from tests.integration.vllm.helpers import PARITY_ATOL, hf_backend, max_gap, score_gap, vllm_config
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

SAMPLINGS = {
    "t1": SamplingConfig(temperature=1.0, max_new_tokens=8),
    "t0.7": SamplingConfig(temperature=0.7, max_new_tokens=8),
    "t0.8-topk5-topp0.9": SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=8),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = vllm_config(tmp_path_factory.mktemp("vllm-cache"))
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
    yield cfg, tokenizer, backend, prompts
    work_dir = backend.work_dir
    backend.close()
    assert not work_dir.exists()


@pytest.fixture(scope="module")
def weightsync(engine):
    """The engine behind a real WeightSync server, and a pusher to it."""
    _, _, backend, _ = engine
    server, port = serve(WeightReceiver(backend))
    with WeightPusher(chunk_bytes=64 << 10) as pusher:
        yield pusher, PushTarget("vllm-0", f"127.0.0.1:{port}")
    server.stop(0)


def seeded(backend, prompts, seed: int, sampling: SamplingConfig) -> list[list[list[int]]]:
    torch.manual_seed(seed)
    return [[c.token_ids for c in g] for g in backend.generate(prompts, 3, sampling)]


def test_k_samples_with_logprobs_finish_reasons_and_reproducible_seeds(engine):
    cfg, _, backend, prompts = engine
    sampling = SAMPLINGS["t1"]
    torch.manual_seed(5)
    groups = backend.generate(prompts, 3, sampling)
    assert [len(g) for g in groups] == [3, 3]
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.token_ids) <= sampling.max_new_tokens and len(c.logprobs) == len(c.token_ids)
        assert all(lp < 0 for lp in c.logprobs)
        assert c.finish == ("length" if len(c.token_ids) == sampling.max_new_tokens else "stop")
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1, "k samples of one prompt should differ"
    # each call's vLLM seed is drawn from torch's RNG: the same torch seed, the same samples; another, others
    assert seeded(backend, prompts, 5, sampling) == [[c.token_ids for c in g] for g in groups]
    assert seeded(backend, prompts, 6, sampling) != seeded(backend, prompts, 5, sampling)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_match_the_hf_backend(engine, name):
    cfg, _, backend, prompts = engine
    reference = load_policy(cfg.model).eval()  # the weights the engine serves until the first push
    assert backend.version == 0
    groups = backend.generate(prompts, 4, SAMPLINGS[name])
    assert max_gap(reference, prompts, groups, SAMPLINGS[name]) <= PARITY_ATOL


def test_hf_backend_returns_the_same_definition_with_top_k_and_top_p(engine):
    cfg, tokenizer, _, prompts = engine
    sampling = SAMPLINGS["t0.8-topk5-topp0.9"]
    hf = hf_backend(cfg, tokenizer)
    reference = load_policy(cfg.model).eval()
    groups = hf.generate(prompts, 4, sampling)
    assert max_gap(reference, prompts, groups, sampling) <= 1e-5


@pytest.mark.parametrize("top_n", [0, 5])
def test_score_tokens_match_the_hf_backend(engine, top_n):
    """Prompt + completion scored by both backends: the model's own log-probs, the same top-n."""
    cfg, tokenizer, backend, prompts = engine
    assert backend.version == 0
    hf = hf_backend(cfg, tokenizer)
    groups = backend.generate(prompts, 2, SAMPLINGS["t1"])
    sequences = [p + c.token_ids for p, g in zip(prompts, groups, strict=True) for c in g] + [prompts[0][:1]]
    ours = backend.score_tokens(sequences, top_n)
    assert [len(s) for s in ours] == [len(s) - 1 for s in sequences]
    assert all(len(top) == top_n for s in ours for _, top in s)
    assert all(top[0][1] >= lp for s in ours for lp, top in s if top)  # most likely first
    assert score_gap(ours, hf.score_tokens(sequences, top_n)) <= PARITY_ATOL


def test_bench_mismatch_measures_the_engine_against_the_trainer(engine):
    """`asyncrlhf bench mismatch` on the module's fp32 engine, before any push (the weights the trainer
    loads): against the fp32 trainer every token is within parity; against a bf16 trainer the same tokens
    are further off."""
    from asyncrlhf.bench.mismatch import measure, report

    cfg, tokenizer, backend, prompts = engine
    assert backend.version == 0
    measured = measure(cfg, backend, tokenizer, prompts, ["float32", "bfloat16"])
    fp32, bf16 = measured["float32"], measured["bfloat16"]
    assert fp32["mismatch_tokens"] == bf16["mismatch_tokens"] > 0
    assert (fp32["mismatch_abs_log_ratio_mean"] <= fp32["mismatch_abs_log_ratio_p99"]
            <= fp32["mismatch_abs_log_ratio_max"] <= PARITY_ATOL)
    assert fp32["mismatch_outside_share"] == 0.0
    assert bf16["mismatch_abs_log_ratio_max"] > fp32["mismatch_abs_log_ratio_max"]
    result = {"model": "tiny", "prompts": len(prompts), "k": 2, "temperature": 1.0, "max_new_tokens": 16,
              "cap": 2.0, "pairs": [{"engine": "float32", "trainer": t, **f} for t, f in measured.items()]}
    rows = [line.split()[:2] for line in report(result)[2:]]
    assert rows == [["float32", "float32"], ["float32", "bfloat16"]]


def test_full_push_through_weightsync_changes_what_the_engine_computes(engine, weightsync):
    cfg, _, backend, prompts = engine
    pusher, target = weightsync
    learner = load_policy(cfg.model).eval()
    before = backend.generate(prompts, 2, SAMPLINGS["t1"])
    weights = perturbed_state_dict(learner, seed=11, scale=0.2)
    (outcome,) = pusher.push(weights, PolicyVersion(0, 1), [target])
    assert outcome.status == "ok", outcome.detail
    assert backend.version == 1
    learner.load_state_dict(weights)
    after = backend.generate(prompts, 2, SAMPLINGS["t0.7"])
    assert max_gap(learner, prompts, after, SAMPLINGS["t0.7"]) <= PARITY_ATOL
    assert max_gap(learner, prompts, before, SAMPLINGS["t1"]) > 0.05  # the old weights' log-probs


def test_a_refused_push_leaves_the_engine_serving_the_old_version(engine, weightsync):
    cfg, _, backend, prompts = engine
    pusher, target = weightsync
    learner = load_policy(cfg.model).eval()
    good = perturbed_state_dict(learner, seed=12, scale=0.2)
    (outcome,) = pusher.push(good, PolicyVersion(0, 2), [target])
    assert outcome.status == "ok", outcome.detail
    learner.load_state_dict(good)
    bad = perturbed_state_dict(learner, seed=13, scale=0.2)
    bad["lm_head.weight"] = bad["lm_head.weight"][:-1]  # wrong shape: refused before anything live changes
    (outcome,) = pusher.push(bad, PolicyVersion(0, 3), [target])
    assert outcome.status == "rejected" and "shape" in outcome.detail
    assert backend.version == 2
    groups = backend.generate(prompts, 2, SAMPLINGS["t1"])
    assert max_gap(learner, prompts, groups, SAMPLINGS["t1"]) <= PARITY_ATOL
    assert torch.isfinite(torch.tensor([lp for g in groups for c in g for lp in c.logprobs])).all()
