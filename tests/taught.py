"""A tiny model taught, in a few seconds of Adam, to answer given prompts with given completions: how the
tests get a model that writes a well-formed tool call (a random one never does). The taught answers are
sampled like any other (greedy, or at any temperature once the answer's probability is near 1): nothing in
the server or the generator is scripted."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def teach(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], *, steps: int = 300,
          lr: float = 3e-3, seed: int = 0) -> torch.nn.Module:
    """Fit `model` to produce each pair's completion ids after its prompt ids (loss on the completions
    only); returns it in eval mode. Stops early once every completion token is the argmax with p > 0.95."""
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        losses, confident = [], True
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            losses.append(-logp.mean())
            confident &= bool((logp.exp() > 0.95).all())
        if confident:
            break
        torch.stack(losses).sum().backward()
        optimizer.step()
    return model.eval()
