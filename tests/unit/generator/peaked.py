"""A state dict for the tiny model that puts (almost) all probability on one token, at every position.

Every embedding row is the same vector and the attention/MLP output projections are zero, so the residual
stream is that vector everywhere; the final norm maps it to ones; the LM head gives `token_id` a logit of
`margin` and every other token 0. So p(token_id) = 1 / (1 + (V - 1) e^-margin) whatever the prompt.
"""

from __future__ import annotations

import torch


def peaked_state_dict(model: torch.nn.Module, token_id: int, margin: float = 32.0) -> dict[str, torch.Tensor]:
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    hidden = state["model.embed_tokens.weight"].shape[1]
    state["model.embed_tokens.weight"].fill_(1.0)
    for name in state:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            state[name].zero_()
    state["model.norm.weight"].fill_(1.0)
    head = torch.zeros_like(state["lm_head.weight"])
    head[token_id] = margin / hidden  # logit = ones . head[token_id] = margin
    state["lm_head.weight"] = head
    return state


def perturbed_state_dict(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: a distinct version whose log-probs differ from the original."""
    gen = torch.Generator().manual_seed(seed)
    return {name: t.detach() + scale * torch.randn(t.shape, generator=gen)
            for name, t in model.state_dict().items()}
