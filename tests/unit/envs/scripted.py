"""Environments for the episode tests: a counter that answers every turn for three turns, and ones that
fail in each way an environment can (raise, hang, answer garbage) at a chosen step."""

from __future__ import annotations

import itertools
import threading


class Counter:
    """Observes "obs i" after turn i (a user message), done with reward 1.0 at turn 3."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, prompt: str) -> str:
        return prompt

    def step(self, action: str):
        self.seen += 1
        if self.seen >= self.turns:
            return "", 1.0, True
        return [{"role": "tool", "content": f"obs {self.seen}"}], 0.0, False


class Raises(Counter):
    def step(self, action: str):
        raise RuntimeError("the sandbox died")


HANG = threading.Event()  # never set: a step that waits on it hangs until the test process ends


class Hangs(Counter):
    def step(self, action: str):
        HANG.wait()


class Garbage(Counter):
    def step(self, action: str):
        return {"not": "a tuple"}


class BadObservation(Counter):
    def step(self, action: str):
        return 42, 0.0, False


class Picky(Counter):
    """A Counter whose step raises for a prompt holding "boom", hangs for one holding "hang", and answers
    garbage for one holding "junk": one environment class, failing for some episodes only."""

    def reset(self, prompt: str) -> str:
        self.prompt = prompt
        return prompt

    def step(self, action: str):
        if "boom" in self.prompt:
            raise RuntimeError("boom")
        if "hang" in self.prompt:
            HANG.wait()
        if "junk" in self.prompt:
            return "not a tuple"
        return super().step(action)


class Together(Counter):
    """Steps only when `Together.barrier.parties` episodes step at the same time (a barrier they all wait
    on): steps taken one after another break the barrier, and the episode ends with an error."""

    barrier = threading.Barrier(4, timeout=10)

    def step(self, action: str):
        self.barrier.wait()
        return super().step(action)


class Drifting(Counter):
    """A Counter whose observations number every step any instance took: a replay into a fresh one sees
    other observations than the episode it replays (an environment that is not deterministic)."""

    steps = itertools.count()

    def step(self, action: str):
        self.seen += 1
        if self.seen >= self.turns:
            return "", 1.0, True
        return [{"role": "tool", "content": f"obs {next(Drifting.steps)}"}], 0.0, False


class Opening(Counter):
    """A Counter whose reset waits until `Opening.released` is set: an environment still opening."""

    released = threading.Event()

    def reset(self, prompt: str) -> str:
        Opening.released.wait(30)
        return prompt
