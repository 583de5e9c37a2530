"""The plan's memory arithmetic by hand, on the `tiny` model of configs/tiny.yaml: vocabulary 259 (256 bytes
+ 3 specials), hidden 64, 2 layers of 4 heads, MLP 128, untied embeddings."""

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.planning import memory as mem
from asyncrlhf.planning.demands import demands
from asyncrlhf.planning.placement import Placement
from asyncrlhf.planning.shapes import model_shape

pytestmark = pytest.mark.unit

# embeddings 259*64 = 16_576; per layer q,k,v,o 4*64*64 = 16_384, gate,up,down 3*64*128 = 24_576 and two norms
# of 64: 41_088, twice = 82_176; the final norm 64; the LM head 259*64 = 16_576
TINY_PARAMS = 16_576 + 82_176 + 64 + 16_576  # = 115_392


def test_the_tiny_model_shape_is_counted_exactly():
    cfg = load_config(["configs/tiny.yaml"])
    shape = model_shape(cfg.model, "causal")
    assert shape.params == TINY_PARAMS == 115_392
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.head_dim, shape.vocab) == (2, 64, 4, 16, 259)
    # LoRA r=16 on q,k,v,o (64 -> 64): 16 * (64 + 64) = 2_048 a module, 4 modules, 2 layers
    lora = cfg.learner.lora.model_copy(update={"enabled": True})
    assert model_shape(cfg.model, "causal", lora).adapter_params == 2_048 * 4 * 2 == 16_384
    # a score head: the LM head (16_576) becomes a 64 -> 1 head
    assert model_shape(cfg.model, "score").params == TINY_PARAMS - 16_576 + 64 == 98_880


def test_zero_stages_split_gradients_and_optimizer_state():
    # 1000 parameters, bf16 mixed precision on 4 ranks: grads 2 B, AdamW 8 B + fp32 master 4 B a parameter
    assert mem.gradients(1000, 2, zero_stage=1, ranks=4) == 2000  # ZeRO-1 keeps whole gradients
    assert mem.gradients(1000, 2, zero_stage=2, ranks=4) == 500  # 2000 / 4
    assert mem.optimizer_state(1000, True, zero_stage=0, ranks=4) == 12_000  # (8 + 4) * 1000
    assert mem.optimizer_state(1000, True, zero_stage=1, ranks=4) == 3000  # 12_000 / 4
    assert mem.optimizer_state(1000, False, zero_stage=2, ranks=4) == 2000  # fp32: no master copy, 8000 / 4
    assert mem.weights(1000, 2, shards=3) == 667  # ZeRO-3: 2000 / 3, rounded up


def test_activations_and_kv_cache_of_the_tiny_model():
    shape = model_shape(load_config(["configs/tiny.yaml"]).model, "causal")
    # 4 rows of 80 tokens in fp32: per layer 34 * 4 * 80 * 64 * (4 / 2) = 1_392_640, 2 layers = 2_785_280;
    # logits 4 * 80 * 259 * 8 = 663_040
    assert mem.training_activations(shape, 4, 80, 4) == 2_785_280 + 663_040
    # without gradients: two layers' worth and the logits, the same here (the model has 2 layers)
    assert mem.inference_activations(shape, 4, 80, 4) == 2_785_280 + 663_040
    # K and V of 2 layers x 4 heads x 16 dims in fp32: 2 * 2 * 4 * 16 * 4 = 1024 bytes a token
    assert mem.kv_cache(shape, 3, 10, 4) == 3 * 10 * 1024


def test_the_tiny_learner_on_one_gpu_holds_what_the_arithmetic_says():
    # configs/tiny.yaml: online DPO (a frozen reference), fp32, ZeRO-0, one rank, micro-batches of 4 rows of
    # max_prompt_tokens 64 + max_new_tokens 16 = 80 tokens
    cfg = load_config(["configs/tiny.yaml"])
    learner = next(p for p in Placement(cfg, gpus=1).processes if p.kind == "learner")
    held = {d.item: (d.device, d.bytes) for d in demands(learner, cfg, gpu_bytes=mem.GIB)}
    weights = 115_392 * 4  # = 461_568
    assert held == {
        "policy weights (float32)": ("gpu 0", weights),
        "policy gradients (ZeRO-0)": ("gpu 0", weights),
        "policy AdamW state (ZeRO-0)": ("gpu 0", 8 * 115_392),  # two fp32 moments, no master copy
        "activations (4 x 80 tokens)": ("gpu 0", 2_785_280 + 663_040),
        "reference policy (float32, frozen)": ("gpu 0", weights),
        "CUDA context and allocator": ("gpu 0", mem.GIB),
        "last pushed version (float32)": ("cpu", weights),
    }


def test_the_time_floor_by_hand():
    from asyncrlhf.planning.timing import ASSUMED_MFU, HBM_BYTES_PER_S, PEAK_FLOPS, step_floor

    # 2 groups of 2 samples of 10 tokens, a 1000-parameter fp32 policy trained whole with a frozen reference:
    # (6 + 2) * 1000 FLOPs a token * 40 tokens = 320_000 FLOPs on one rank at the assumed share of the peak;
    # one batch of 4 prompts holds both groups: 16 new tokens, each reading 1000 * 4 bytes of weights
    cfg = load_config(["configs/tiny.yaml"], ["learner.groups_per_step=2", "generator.samples_per_prompt=2",
                                              "generator.batch_prompts=4",
                                              "generator.sampling.max_new_tokens=16"])
    shape = mem.Shape(params=1000, layers=1, hidden=8, kv_heads=1, head_dim=8, vocab=10)
    floor = step_floor(cfg, shape, None, needs_reference=True, tokens=10)
    assert floor.train_s == pytest.approx(320_000 / (PEAK_FLOPS * ASSUMED_MFU))
    assert floor.generate_s == pytest.approx(16 * 4000 / HBM_BYTES_PER_S)
    assert floor.overlapped and floor.step_s == floor.generate_s  # max_staleness 1: the longer of the two
