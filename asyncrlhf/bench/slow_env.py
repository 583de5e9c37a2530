"""A variable-latency environment for benchmarking episodes (`asyncrlhf bench pipeline ... task.env.kind=class
task.env.path=asyncrlhf/bench/slow_env.py:SlowSteps`): every step takes a random time, as a tool call or a
sandbox does, and the episode lasts `turns` model turns whatever the model writes, so batch and continuous
episodes do the same work. The reward (at the last step) is 1 when the model's last turn holds a digit.

The sleep of a step is drawn from the prompt and the turn (the same on a replay, and in every run), uniform
in [0, `max_s`): a batch of episodes waits for its slowest step each turn; continuous episodes do not.
"""

from __future__ import annotations

import random
import time
import zlib


class SlowSteps:
    def __init__(self, turns: int = 3, max_s: float = 1.0):
        self.turns, self.max_s, self.seen, self.prompt = turns, max_s, 0, ""

    def reset(self, prompt: str) -> str:
        self.prompt = prompt
        return prompt

    def step(self, action: str):
        self.seen += 1
        seed = zlib.crc32(f"{self.prompt}|{self.seen}".encode())
        time.sleep(random.Random(seed).uniform(0.0, self.max_s))
        if self.seen >= self.turns:
            return "", float(any(c.isdigit() for c in action)), True
        return f"Step {self.seen} done. Go on.", 0.0, False
