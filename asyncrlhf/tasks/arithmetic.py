"""The arithmetic tasks: questions like "What is 23 * 7?" with their answers as references, for tool use (a
calculator tool, the answer verified against the reference).

`arithmetic`: mostly one-digit sums, which the demo model answers by itself about half the time.
`calculator` (`configs/tools_calculator.yaml`): products of two-digit numbers and the like, which it cannot
answer by itself, so the reward comes from calling the tool; `calculator_calls` are the tool-call
demonstrations its warm start (`asyncrlhf sft`) trains on, written to `configs/data/calculator_calls.jsonl`
by `tools/gen_calculator_calls.py`.

Built deterministically in code (nothing downloaded) by seeded generators; every 10th question is held
out.
"""

from __future__ import annotations

import operator
import random

from asyncrlhf.chat_format import ToolCall

OPS = ("+", "-", "*")
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SIZE = 1100
CALCULATOR_SIZE = 640


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


def _calculator_questions() -> list[tuple[str, str]]:
    """Two-digit products, and products plus a two-digit number: beyond the demo model unaided. Distinct,
    so no held-out question is also a training one."""
    rng = random.Random(41)
    out: dict[str, str] = {}
    while len(out) < CALCULATOR_SIZE:
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(10, 99)
        if rng.random() < 0.6:
            expression, answer = f"{a} * {b}", a * b
        else:
            expression, answer = f"{a} * {b} + {c}", a * b + c
        out.setdefault(f"What is {expression}?", str(answer))
    return list(out.items())


def expression_of(question: str) -> str:
    return question.removeprefix("What is ").removesuffix("?")


def calculator_calls(n: int) -> list[dict[str, str]]:
    """The first `n` train questions of `calculator`, each with the calculator call that answers it (the
    Hermes convention the episodes parse) as {prompt, completion}."""
    train, _, _, _ = split("calculator")
    return [{"prompt": q, "completion": ToolCall("calculator", {"expression": expression_of(q)}).text()}
            for q in train[:n]]


def split(name: str = "arithmetic") -> tuple[list[str], list[str], list[str], list[str]]:
    """(train prompts, train answers, eval prompts, eval answers) of `arithmetic` or `calculator`."""
    questions = _calculator_questions() if name == "calculator" else _questions()
    train = [q for i, q in enumerate(questions) if i % 10]
    held = [q for i, q in enumerate(questions) if not i % 10]
    return [q for q, _ in train], [a for _, a in train], [q for q, _ in held], [a for _, a in held]
