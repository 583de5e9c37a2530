"""The live progress display of `asyncrlhf up`: a table with a progress bar on a terminal, a log line every
10 s elsewhere (CI, tests, files).

It shows the run's state as last known: each service's metrics are kept from its last answer, so a service
that has exited (the learner at the end of the run) still shows its final values, and the final frame is the
final state. A value not known yet reads `–` (no reward before the first step, no gold reward before the
first evaluation). The learner's KL is the k1 estimate, mean log(pi / pi_ref) over sampled tokens: unbiased,
but a single step's value can be negative, so it is labelled as such. While the learner runs, a row says
what it waits on, or, once it has gone `launch.stall_after_s` without a step, where it stalled and why (the
launcher's `StallMonitor` judges; asyncrlhf.stalls).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol

from asyncrlhf import metrics as names
from asyncrlhf.stalls import Stall, Wait, Waiting

UNKNOWN = "–"


class Scraped(Protocol):
    """One scrape of every service's /metrics (`asyncrlhf.scrape.Snapshot`)."""

    values: dict[str, float]
    generator_versions: dict[str, float]
    answered: dict[str, bool]
    per_service: dict[str, dict[str, float]]
    waiting: dict[str, tuple[str, float]]  # service -> (what it waits on, since: Unix time)


class RunState:
    """The last known metrics of every service, merged over scrapes."""

    def __init__(self, total_steps: int, clock=time.monotonic, generator: str | None = None):
        self.total_steps, self.clock = total_steps, clock
        self.generator = generator  # the generator backend (and why, when `auto` chose it)
        self.started = clock()
        self.per_service: dict[str, dict[str, float]] = {}
        self.generator_versions: dict[str, float] = {}
        self.queues: dict[str, float] = {}
        self.first_step: tuple[float, float] | None = None  # (time, steps) when steps were first seen > 0
        self.last_step: tuple[float, float] | None = None  # (time, steps) when steps last went up
        # The learner's final checkpoint version, read after it exits (it may step after the last scrape).
        self.final_version: int | None = None
        self.answering: dict[str, bool] = {}  # whether each service answered the last scrape
        self.answered_at: dict[str, float] = {}  # when each last answered
        self.waiting: dict[str, Waiting] = {}  # what each service waits on, as it last said
        self.stepped_at = self.started  # when the learner's step count last changed
        self._seen_steps: float | None = None
        self.stall: Stall | None = None  # the launcher's judgement, while the learner runs

    def update(self, snap: Scraped) -> None:
        self.answering = dict(snap.answered)
        for name, own in snap.per_service.items():
            if snap.answered.get(name):
                self.per_service[name] = dict(own)
        for name, ok in snap.answered.items():
            if ok:
                self.answered_at[name] = self.clock()
                self._waits(name, snap.waiting.get(name))
        self.generator_versions.update(snap.generator_versions)
        queues = {k[len("queue:"):]: v for k, v in snap.values.items() if k.startswith("queue:")}
        if queues:
            self.queues = queues
        steps = self.get(names.LEARNER_STEPS_TOTAL)
        if steps != self._seen_steps:
            self._seen_steps, self.stepped_at = steps, self.clock()
        if steps and (self.last_step is None or steps > self.last_step[1]):
            self.last_step = (self.clock(), steps)
            self.first_step = self.first_step or self.last_step

    def _waits(self, name: str, said: tuple[str, float] | None) -> None:
        known = {w.value for w in Wait}
        if said is None or said[0] not in known:  # it works (or says something this launcher predates)
            self.waiting.pop(name, None)
        else:
            self.waiting[name] = Waiting(Wait(said[0]), said[1])

    def stepless_s(self) -> float:
        """Since the learner's step count last changed (or the run started)."""
        return self.clock() - self.stepped_at

    def silent_s(self, name: str, starting: bool = False) -> float | None:
        """Since `name` last answered a scrape, when it did not answer the last one; None when it did. One
        that never answered is still starting: None, unless `starting` asks since when (the run's start)."""
        if self.answering.get(name) or (name not in self.answered_at and not starting):
            return None
        return self.clock() - self.answered_at.get(name, self.started)

    def get(self, metric: str) -> float | None:
        """The metric summed over the services that have reported it; None when none has."""
        found = [own[metric] for own in self.per_service.values() if metric in own]
        return sum(found) if found else None

    @property
    def scraped_steps(self) -> float | None:
        return self.get(names.LEARNER_STEPS_TOTAL)

    @property
    def steps(self) -> float | None:
        """Steps trained: the last scrape's, or the final checkpoint's once the learner has exited."""
        scraped = self.scraped_steps
        if self.final_version is not None and (scraped is None or self.final_version - 1 > scraped):
            return float(self.final_version - 1)
        return scraped

    @property
    def learner_version(self) -> float | None:
        steps = self.steps
        return None if steps is None else steps + 1 if self.final_version else self.get(names.LEARNER_VERSION)

    def rate(self) -> float | None:
        """Steps per second from the first step seen to the last (so it holds still once the run is over)."""
        if self.first_step is None or self.last_step is None or self.last_step[1] <= self.first_step[1]:
            return None
        return (self.last_step[1] - self.first_step[1]) / max(self.last_step[0] - self.first_step[0], 1e-9)


def _num(value: float | None, spec: str) -> str:
    return UNKNOWN if value is None or value != value else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return UNKNOWN
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


def rows(state: RunState) -> list[tuple[str, str]]:
    steps = state.steps
    trained = steps is not None and steps > 0
    count = state.get(f"{names.LEARNER_STALENESS_VERSIONS}_count")
    total = state.get(f"{names.LEARNER_STALENESS_VERSIONS}_sum")
    evaluated = bool(state.get(names.EVALUATOR_EVALUATIONS_TOTAL))
    rate = state.rate()
    eta = (state.total_steps - steps) / rate if rate and steps is not None else None
    first = state.first_step[0] - state.started if state.first_step else None
    versions = " ".join(f"{int(v)}" for _, v in sorted(state.generator_versions.items())) or UNKNOWN
    learner_version = state.learner_version
    scraped = state.scraped_steps
    # Reward and KL come from the last scrape; say which step when the learner went on after it.
    behind = trained and scraped is not None and steps is not None and scraped < steps
    at = f" (step {scraped:.0f})" if behind else ""
    backend = [("generator", state.generator)] if state.generator else []
    return [
        *backend,
        ("step", f"{_num(steps, '.0f')}/{state.total_steps}"),
        ("speed", f"{_num(rate, '.2f')} steps/s, eta {_duration(eta)}, first step after {_duration(first)}"),
        ("version", f"learner {_num(learner_version, '.0f')}, generators {versions}"),
        ("reward", _num(state.get(names.LEARNER_REWARD_MEAN), ".3f") + at if trained else UNKNOWN),
        ("kl (k1 est., may be < 0)", _num(state.get(names.LEARNER_KL), ".4f") + at if trained else UNKNOWN),
        ("staleness", _num(total / count, ".2f") if count and total is not None else UNKNOWN),
        ("gen tok/s", _num(state.get(names.GENERATOR_TOKENS_PER_SECOND), ".1f")),
        ("queues", " ".join(f"{k}={int(v)}" for k, v in sorted(state.queues.items())) or UNKNOWN),
        ("gold", _num(state.get(names.EVALUATOR_GOLD_REWARD), ".3f") if evaluated else UNKNOWN),
        _waiting_row(state),
        ("elapsed", _duration(state.clock() - state.started)),
    ]


def _waiting_row(state: RunState) -> tuple[str, str]:
    """Where the learner stalled and why; else what it waits on now."""
    if state.stall is not None:
        return "STALLED", f"at {state.stall.hop}: {state.stall.message}"
    wait = state.waiting.get("learner")
    if wait is None:
        return "learner waits on", UNKNOWN
    return "learner waits on", f"{wait.on} for {_duration(wait.seconds(time.time()))}"


class Progress:
    """Shows `RunState` as a live table (on a terminal, or on the `console` given) or as log lines."""

    def __init__(self, total_steps: int, console=None, clock=time.monotonic,
                 final_version: Callable[[], int | None] = lambda: None, generator: str | None = None):
        self.state = RunState(total_steps, clock, generator)
        self.final_version = final_version
        self.live = None
        self._last_line: float | None = None
        if console is not None or sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(self.render(), console=console, refresh_per_second=2, transient=False)
            self.live.start()

    def update(self, snap: Scraped) -> None:
        self.state.update(snap)
        if self.live is not None:
            self.live.update(self.render())
        elif self._last_line is None or self.state.clock() - self._last_line >= 10:
            self._print_line()

    def render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(title="asyncrlhf up", show_header=False)
        for key, value in rows(self.state):
            table.add_row(key, value)
        bar = ProgressBar(total=max(self.state.total_steps, 1), completed=self.state.steps or 0, width=40)
        return Group(table, bar)

    def close(self) -> None:
        """Show the final state (last known values, the final checkpoint's version) once more, and stop."""
        try:
            self.state.final_version = self.final_version()
        except Exception:  # the display must close whatever the run directory holds
            self.state.final_version = None
        if self.live is not None:
            self.live.update(self.render(), refresh=True)
            self.live.stop()
        else:
            self._print_line()

    def _print_line(self) -> None:
        self._last_line = self.state.clock()
        print("progress: " + ", ".join(f"{k}={v}" for k, v in rows(self.state)), flush=True)
