"""A `verifiers` environment shipped with asyncrlhf (nothing to download): arithmetic questions answered with
a calculator tool, as a `verifiers.ToolEnv` whose rubric gives 1 when the final answer (the last assistant
message, the one with no call) equals the reference. Loaded by `verifiers.load_environment`:

    task:
      name: arithmetic
      env: {kind: verifiers, name: asyncrlhf.envs.vf_arithmetic, args: {max_turns: 3}}

Needs the `envs` extra (pip install 'asyncrlhf[envs]').
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from asyncrlhf.envs.loading import calculator
from asyncrlhf.rewards.math import math_score
from asyncrlhf.tasks import arithmetic

SYSTEM_PROMPT = "Answer the arithmetic question. You may call the calculator tool; give the number last."


def correct(completion, answer) -> float:
    """1 when the last assistant message's number equals the reference answer."""
    said = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return math_score(said[-1] if said else "", answer or "")


def load_environment(max_turns: int = 3, system_prompt: str | None = SYSTEM_PROMPT,
                     num_examples: int = 64) -> vf.Environment:
    """`num_examples` questions of the arithmetic task's train split as the environment's own dataset (for
    verifiers' own evaluation; asyncrlhf feeds the task's prompts)."""
    prompts, answers, _, _ = arithmetic.split()
    dataset = Dataset.from_dict({"question": prompts[:num_examples], "answer": answers[:num_examples]})
    return vf.ToolEnv(tools=[calculator], max_turns=max_turns, dataset=dataset, system_prompt=system_prompt,
                      rubric=vf.Rubric(funcs=[correct]))
