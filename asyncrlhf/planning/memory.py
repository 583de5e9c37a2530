"""Memory arithmetic of a run, in bytes: pure functions of a model's shape and the run's sizes, no I/O.

Every figure is an estimate of what a process holds at its peak, with the approximation it rests on:
- weights: parameters x bytes of their dtype;
- training (DeepSpeed, AdamW): gradients in the compute dtype, two fp32 moments per trained parameter, and in
  bf16 an fp32 master copy too (Rajbhandari et al. 2020, "ZeRO", sec. 3: 2 + 2 + 12 bytes a parameter).
  ZeRO-1 splits the optimizer state across the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too;
- activations kept for the backward pass: Korthikanti et al. 2022 ("Reducing Activation Recomputation",
  eq. 1) without its attention-score term, since PyTorch's SDPA kernels keep no (T x T) scores: 34 bytes per
  token and hidden unit per layer in 16-bit, scaled by the dtype. Plus the logits, kept in fp32 with their
  log-softmax (2 x 4 bytes per token and vocabulary entry): at a 50k vocabulary they outweigh the layers;
- a forward pass without gradients (scoring, the reference) keeps about two layers' activations at once;
- a KV cache: 2 (K and V) x layers x KV heads x head size x bytes, per token;
- every process on a GPU: about 1 GiB of CUDA context, kernels and allocator slack (CONTEXT_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
CONTEXT_BYTES = GIB  # CUDA context + kernel images + allocator fragmentation, per process and GPU
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 8  # fp32 first and second moment
MASTER_COPY = 4  # fp32 master weights of mixed-precision training
ACTIVATION_BYTES_16BIT = 34  # Korthikanti et al. 2022, eq. 1, per token, hidden unit and layer (16-bit)
LOGIT_BYTES = 8  # fp32 logits and their log-softmax, per token and vocabulary entry


@dataclass(frozen=True)
class Shape:
    """What the arithmetic needs of a model: parameter counts and the sizes activations scale with."""

    params: int  # every weight
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int  # logits per token (1 for a score head)
    max_positions: int = 2048  # the longest sequence the model takes (vLLM's default max_model_len)
    adapter_params: int = 0  # LoRA adapters, when the run trains them instead of the weights

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache per token: K and V of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def weights(params: int, dtype_bytes: int, shards: int = 1) -> int:
    """Weights held, split over `shards` ranks (ZeRO-3), else whole."""
    return -(-params * dtype_bytes // shards)


def gradients(trained: int, dtype_bytes: int, zero_stage: int, ranks: int) -> int:
    """Gradients of the trained parameters in the compute dtype; ZeRO-2 and -3 split them."""
    return -(-trained * dtype_bytes // (ranks if zero_stage >= 2 else 1))


def optimizer_state(trained: int, mixed_precision: bool, zero_stage: int, ranks: int) -> int:
    """AdamW's moments (and the fp32 master copy in mixed precision); ZeRO-1 and above split them."""
    per_param = ADAM_MOMENTS + (MASTER_COPY if mixed_precision else 0)
    return -(-trained * per_param // (ranks if zero_stage >= 1 else 1))


def training_activations(shape: Shape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Activations a forward keeps for its backward, for `sequences` rows of `tokens`, and the logits."""
    per_layer = ACTIVATION_BYTES_16BIT * sequences * tokens * shape.hidden * dtype_bytes // 2
    return shape.layers * per_layer + sequences * tokens * shape.vocab * LOGIT_BYTES


def inference_activations(shape: Shape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Peak activations of a forward without gradients: two layers' worth, and the logits."""
    per_layer = ACTIVATION_BYTES_16BIT * sequences * tokens * shape.hidden * dtype_bytes // 2
    return 2 * per_layer + sequences * tokens * shape.vocab * LOGIT_BYTES


def kv_cache(shape: Shape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """KV cache of `sequences` sequences of `tokens` tokens."""
    return sequences * tokens * shape.kv_bytes_per_token(dtype_bytes)
