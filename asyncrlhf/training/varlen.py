"""Varlen attention for packed rows: each sample's attention on its own block, so a packed row of L tokens
costs the sum of its samples' squared lengths in attention, not L x L under a block-diagonal mask.

Registered with transformers' attention interface under `NAME` (with SDPA's mask function, so a call without
packed boundaries is plain SDPA with its usual mask); a model whose attention goes through that interface
(`_supports_attention_backend`, the decoder models of transformers 5) is switched to it the first time a
packed row runs. The row's sample boundaries reach every attention layer as `cu_seq_lens_q`/`cu_seq_lens_k`
(the keyword arguments transformers passes through to attention for varlen kernels); on GPUs with
flash-attention installed the same boundaries would feed its varlen kernel, not wired here.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "asyncrlhf_varlen"
_switched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models switched to it


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """(B, H, L, D) query, key, value -> (B, L, H, D): causal attention inside each [cu[i], cu[i+1]) block of
    `cu_seq_lens_q`; without it, SDPA with `attention_mask`."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    cuts = bounds.tolist()
    gqa = query.shape[1] != key.shape[1]
    blocks = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                             is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa)
              for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DeepSpeed's engine and peft's wrappers."""
    while True:
        unwrap = getattr(model, "get_base_model", None)
        inner = unwrap() if callable(unwrap) else getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def enable(model: torch.nn.Module) -> bool:
    """Switch `model` to varlen attention if its attention goes through transformers' interface; whether it
    now runs packed rows that way (if not, they take the 4D block-diagonal mask)."""
    base = _base(model)
    if base in _switched:
        return True
    if not isinstance(base, PreTrainedModel) or not getattr(base, "_supports_attention_backend", False):
        return False
    _register()
    base.set_attn_implementation(NAME)
    _switched.add(base)
    return True


def boundaries(segment_lengths: list[int], device: torch.device) -> dict[str, torch.Tensor | int]:
    """The keyword arguments that carry a packed row's sample boundaries to every attention layer."""
    cu = torch.tensor([0, *segment_lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    longest = max(segment_lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
