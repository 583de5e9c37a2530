import pytest
import torch

from asyncrlhf.config import SamplingConfig, load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.hf import HFBackend, left_pad, positions, trim_at_eos
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors
from tests.unit.generator.peaked import peaked_state_dict, perturbed_state_dict

pytestmark = pytest.mark.unit
LOGPROB_ATOL = 1e-4  # fp32 tiny model: incremental (KV-cache, padded) vs one unpadded pass differ by ~1e-6


def test_left_pad_pads_short_prompts_on_the_left():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[5], []], pad_id=0)


def test_positions_count_only_real_tokens():
    # cumsum(mask) - 1: row 0 [1,2,3]-1 = [0,1,2]; row 1 [0,0,1]-1 = [-1,-1,0], clamped to [0,0,0]
    assert positions(torch.tensor([[1, 1, 1], [0, 0, 1]])).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_trim_at_eos_keeps_the_eos_and_drops_what_follows():
    assert trim_at_eos([4, 2, 0, 0], {2}) == ([4, 2], "stop")
    assert trim_at_eos([2, 5], {2, 7}) == ([2], "stop")
    assert trim_at_eos([4, 5], {2}) == ([4, 5], "length")


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu"])
    tokenizer = load_tokenizer(cfg.model)
    return cfg, tokenizer, HFBackend.from_config(cfg, tokenizer)


def test_logprobs_are_the_sampled_tokens_under_the_temperature(tiny):
    cfg, tokenizer, backend = tiny
    reference = load_policy(cfg.model).eval()
    weights = perturbed_state_dict(reference, seed=7)
    reference.load_state_dict(weights)
    backend.apply_weights(weights, version=PolicyVersion(0, 3))
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=12)
    prompts = encode_prompts(tokenizer, ["hi", "a much longer prompt, so the batch is padded"], cfg.model)
    groups = backend.generate(prompts, 3, sampling)
    assert backend.version == 3 and [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0
            assert (c.finish == "stop") == (c.token_ids[-1] == tokenizer.eos_token_id)
            assert c.finish == "stop" or len(c.token_ids) == sampling.max_new_tokens
            # one unpadded sequence, no cache: logits at t predict token t + 1
            full = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = reference(input_ids=full).logits[0, len(prompt) - 1:-1].float()
            picked = torch.tensor(c.token_ids)[:, None]
            expected = torch.log_softmax(logits / 0.7, -1).gather(-1, picked)[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_a_model_that_prefers_eos_stops_at_once(tiny):
    cfg, tokenizer, backend = tiny
    peaked = peaked_state_dict(load_policy(cfg.model), tokenizer.eos_token_id)
    backend.apply_weights(peaked, version=PolicyVersion(0, 4))
    groups = backend.generate(encode_prompts(tokenizer, ["x", "yy"], cfg.model), 2, cfg.generator.sampling)
    for c in (c for g in groups for c in g):
        assert c.token_ids == [tokenizer.eos_token_id] and c.finish == "stop"
        assert c.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_a_model_that_prefers_one_token_samples_only_it(tiny):
    cfg, tokenizer, backend = tiny
    a = tokenizer("a", add_special_tokens=False)["input_ids"][0]
    backend.apply_weights(peaked_state_dict(load_policy(cfg.model), a), version=PolicyVersion(0, 5))
    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=7)
    (group,) = backend.generate(encode_prompts(tokenizer, ["anything"], cfg.model), 4, sampling)
    assert [c.token_ids for c in group] == [[a] * 7] * 4
    assert all(c.finish == "length" for c in group)


def test_apply_weights_adopts_the_tensors_only_when_handed_over(tiny):
    cfg, tokenizer, _ = tiny
    backend = HFBackend.from_config(cfg, tokenizer)
    name = next(n for n in backend.named_tensors() if n.endswith("q_proj.weight"))  # not a tied weight
    live = backend.named_tensors()[name]
    kept = {name: torch.ones_like(live)}
    copied = backend.apply_weights(kept, version=PolicyVersion(0, 1))
    assert copied == {} and backend.version == 1  # copied: still the caller's
    assert backend.named_tensors()[name].data_ptr() != kept[name].data_ptr()
    handed = {name: torch.full_like(live, 2.0)}
    replaced = backend.apply_weights(handed, version=PolicyVersion(0, 2), adopt=True)
    assert backend.named_tensors()[name].data_ptr() == handed[name].data_ptr()  # its live storage now
    assert torch.equal(replaced[name], kept[name]) and backend.version == 2  # the storage it replaced


def test_lora_backend_exposes_the_learners_adapter_names():
    cfg = load_config(["configs/tiny.yaml"],
                      ["generator.device=cpu", "learner.lora.enabled=true", "learner.lora.r=4"])
    tokenizer = load_tokenizer(cfg.model)
    backend = HFBackend.from_config(cfg, tokenizer)
    learner_adapters = adapter_tensors(load_policy(cfg.model, lora=cfg.learner.lora).state_dict())
    assert set(backend.named_tensors()) == set(learner_adapters) and learner_adapters
    prompts = encode_prompts(tokenizer, ["hello"], cfg.model)
    torch.manual_seed(0)
    before = backend.generate(prompts, 1, cfg.generator.sampling)[0][0]
    # lora_B starts at 0 (the adapter is a no-op); a push of 0.5 everywhere is a real change
    pushed = {name: torch.full_like(t, 0.5) for name, t in learner_adapters.items()}
    backend.apply_weights(pushed, version=PolicyVersion(0, 1))
    torch.manual_seed(0)
    after = backend.generate(prompts, 1, cfg.generator.sampling)[0][0]
    assert backend.version == 1 and after.logprobs != before.logprobs


def test_merged_lora_samples_the_adapted_model_and_does_not_drift():
    """The generator folds the adapter into the base weights: sampling must match the unmerged adapter model,
    and merging is redone from pristine base weights, so a zero adapter gives the base back bit for bit."""
    cfg = load_config(["configs/tiny.yaml"],
                      ["generator.device=cpu", "learner.lora.enabled=true", "learner.lora.r=4"])
    tokenizer = load_tokenizer(cfg.model)
    backend = HFBackend.from_config(cfg, tokenizer)
    reference = load_policy(cfg.model, lora=cfg.learner.lora).eval()

    def base_weights() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in backend.model.state_dict().items() if "lora_" not in n}

    pristine = base_weights()
    prompts = encode_prompts(tokenizer, ["hi", "a longer prompt, so that the batch is padded"], cfg.model)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=8)
    generator = torch.Generator().manual_seed(3)
    for version in (1, 2):
        pushed = {n: 0.3 * torch.randn(t.shape, generator=generator)
                  for n, t in backend.named_tensors().items()}
        backend.apply_weights(pushed, version=PolicyVersion(0, version))
        reference.load_state_dict(pushed, strict=False)
        assert any(not torch.equal(base_weights()[n], pristine[n]) for n in pristine)  # merged in
        for prompt, group in zip(prompts, backend.generate(prompts, 2, sampling), strict=True):
            for c in group:
                full = torch.tensor([prompt + c.token_ids])
                with torch.no_grad():
                    logits = reference(input_ids=full).logits[0, len(prompt) - 1:-1].float()
                expected = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
                torch.testing.assert_close(torch.tensor(c.logprobs), expected[:, 0], atol=LOGPROB_ATOL,
                                           rtol=0)
    zeros = {n: torch.zeros_like(t) for n, t in backend.named_tensors().items()}
    backend.apply_weights(zeros, version=PolicyVersion(0, 3))
    assert all(torch.equal(base_weights()[n], pristine[n]) for n in pristine)


def test_the_step_hook_runs_once_per_decoding_step_and_changes_no_sample(tiny):
    """The core share re-sizes torch's threads from this hook (asyncrlhf/cores.py): it must not touch what
    is sampled."""
    cfg, tokenizer, backend = tiny
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    prompts = encode_prompts(tokenizer, ["hi", "hello there"], cfg.model)
    torch.manual_seed(11)
    plain = backend.generate(prompts, 2, sampling)
    calls = []
    backend.step_hook = lambda: calls.append(1)
    try:
        torch.manual_seed(11)
        hooked = backend.generate(prompts, 2, sampling)
    finally:
        backend.step_hook = None
    assert hooked == plain
    longest = max(len(c.token_ids) for g in hooked for c in g)
    assert len(calls) == longest  # one call per decoding step: the batch stops when its last row does
