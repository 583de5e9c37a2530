"""The arithmetic task: questions like "What is 23 * 7?" with their answers as references, for the tool-use
workload (`configs/tools_calculator.yaml`: a calculator tool, the answer verified against the reference).

Built deterministically in code (nothing downloaded) by a seeded generator; every 10th question is held
out.
"""

from __future__ import annotations

import operator
import random

OPS = ("+", "-", "*")
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SIZE = 1100


def _questions() -> list[tuple[str, str]]:
    """70% one-digit sums (the demo model answers about a third of them right by itself: a reward that can
    rise), 30% three-operand expressions up to 30 (where the calculator pays)."""
    rng = random.Random(40)
    out = []
    for _ in range(SIZE):
        if rng.random() < 0.7:
            x, y = rng.randint(1, 9), rng.randint(1, 9)
            expression, answer = f"{x} + {y}", x + y
        else:
            a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 9)
            first, second = rng.choice(OPS), rng.choice(OPS)
            expression = f"({a} {first} {b}) {second} {c}"
            answer = APPLY[second](APPLY[first](a, b), c)
        out.append((f"What is {expression}?", str(answer)))
    return out


def split() -> tuple[list[str], list[str], list[str], list[str]]:
    """(train prompts, train answers, eval prompts, eval answers)."""
    questions = _questions()
    train = [q for i, q in enumerate(questions) if i % 10]
    held = [q for i, q in enumerate(questions) if not i % 10]
    return [q for q, _ in train], [a for _, a in train], [q for q, _ in held], [a for _, a in held]
