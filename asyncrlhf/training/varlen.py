"""Varlen attention for packed rows: each sample's attention on its own block, so a packed row of L tokens
costs the sum of its samples' squared lengths in attention, not L x L under a block-diagonal mask.

Registered with transformers' attention interface under `NAME` (with SDPA's mask function, so a call without
packed boundaries is plain attention with its usual mask); a model whose attention goes through that interface
(`_supports_attention_backend`, the decoder models of transformers 5) is switched to it the first time a
packed row runs. The row's sample boundaries reach every attention layer as `cu_seq_lens_q`/`cu_seq_lens_k`
(the keyword arguments transformers passes through to attention for varlen kernels); on GPUs with
flash-attention installed the same boundaries would feed its varlen kernel, not wired here.

A layer asks a varlen kernel for more than causal attention through the keyword arguments of transformers'
flash-attention contract, and each is kept here as the model's own eager attention computes it:
`sliding_window` (Mistral, Gemma 2/3, gpt-oss, Qwen with windows: a query sees the last `sliding_window` keys
of its sample, itself included), `softcap` (Gemma 2: scores become softcap * tanh(scores / softcap) before the
mask) and `s_aux` (gpt-oss's attention sinks: one learned logit per head joins each query's softmax and takes
its share of the probability, then is dropped).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "asyncrlhf_varlen"
_switched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models switched to it


@dataclass(frozen=True)
class Asks:
    """What a layer asks of attention beyond causal (the keyword arguments of transformers' flash-attention
    contract; see the module)."""

    window: int | None = None  # `sliding_window`
    softcap: float | None = None  # `softcap`
    sinks: torch.Tensor | None = None  # `s_aux`, (H,)

    @classmethod
    def of(cls, kwargs: dict) -> Asks:
        return cls(kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux"))

    @property
    def written_out(self) -> bool:
        """Whether only attention written out gives it (SDPA takes neither a softcap nor a sink)."""
        return self.softcap is not None or self.sinks is not None


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """(B, H, L, D) query, (B, H_kv, L, D) key and value -> (B, L, H, D): causal attention inside each
    [cu[i], cu[i+1]) block of `cu_seq_lens_q`; without it, attention under `attention_mask`."""
    asks = Asks.of(kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        if not asks.written_out:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        allowed = _allowed(query.shape[2], None, query.device) if attention_mask is None else attention_mask
        return _eager(query, key, value, allowed, scale, dropout, asks).transpose(1, 2), None
    cuts = bounds.tolist()
    blocks = [_block(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scale, dropout, asks)
              for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float,
           asks: Asks) -> torch.Tensor:
    """(B, H, n, D) attention of one sample's block on itself: (B, H, n, D)."""
    n = query.shape[2]
    if not asks.written_out:
        windowed = asks.window is not None and asks.window < n  # else the window masks nothing causal keeps
        mask = _allowed(n, asks.window, query.device) if windowed else None
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, dropout_p=dropout,
                                              enable_gqa=query.shape[1] != key.shape[1])
    return _eager(query, key, value, _allowed(n, asks.window, query.device), scale, dropout, asks)


def _allowed(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(n, n) bool: query i may attend key j (j <= i, and i - j < window where there is one)."""
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]
    return (gap >= 0) & (gap < window) if window is not None else gap >= 0


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
           dropout: float, asks: Asks) -> torch.Tensor:
    """(B, H, n, D) attention written out, as the models' eager attention computes it: scores softcapped
    before the mask (`allowed`, bool, broadcast to (B, H, n, n)), a sink logit per head in the softmax."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale
    if asks.softcap is not None:
        scores = asks.softcap * torch.tanh(scores / asks.softcap)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if asks.sinks is not None:
        sink = asks.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    probs = F.dropout(probs, p=dropout, training=dropout > 0).to(value.dtype)
    return torch.matmul(probs, value)


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


def supported(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention (under its wrappers) goes through transformers' attention interface, and so
    transformers builds its masks (`transformers.masking_utils`)."""
    base = _base(model)
    return isinstance(base, PreTrainedModel) and getattr(base, "_supports_attention_backend", False)


def windowed(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s attention layers has a sliding window (its config's `sliding_window`, on
    every layer or on those `layer_types` names `sliding_attention`)."""
    config = getattr(_base(model), "config", None)
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def enable(model: torch.nn.Module) -> bool:
    """Switch `model` to varlen attention if its attention goes through transformers' interface; whether it
    now runs packed rows that way (if not, they take the block-diagonal mask)."""
    base = _base(model)
    if base in _switched:
        return True
    if not isinstance(base, PreTrainedModel) or not supported(base):
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
