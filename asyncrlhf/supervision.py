"""Restart policy of `asyncrlhf up`: a crashed service restarts after a back-off, and the cap is a rate.

`RestartPolicy` is pure (it is told the time), so the launcher and the tests drive it the same way: a crash
at time t either schedules a restart (`Restart(at=...)`) or, when the service already restarted
`max_restarts` times within the last `window_s` seconds, gives up (`None`). The back-off doubles with each
restart still inside the window and is capped, so a service that crashes in a loop waits longer each time
and one that crashed once an hour ago restarts at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# What stops when a service cannot be restarted: the message names it so the operator knows what is at risk.
AT_RISK = {
    "learner": "training stopped; every group still in the streams stays there and `asyncrlhf up` again "
    "resumes from the latest checkpoint, re-training the groups trained after it",
    "generator": "no rollouts are generated; enqueued prompts wait in Redis and are claimed by a "
    "generator of the next run",
    "reward": "no rollouts are scored; they wait in Redis and are claimed by a reward replica of the "
    "next run",
    "evaluator": "checkpoints are no longer evaluated; training was not affected",
}


@dataclass
class Restart:
    at: float  # when to start the service again
    count: int  # restarts within the window, this one included


@dataclass
class RestartPolicy:
    max_restarts: int
    window_s: float
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 10.0
    times: deque[float] = field(default_factory=deque)  # when each restart in the window happened
    total: int = 0
    streak: int = 0  # crashes in a row, each sooner than stable_s after its start

    def on_crash(self, now: float, uptime_s: float = 0.0) -> Restart | None:
        """The restart to schedule for a crash at `now` of a process that ran `uptime_s`, or None when the
        cap (a rate) is reached."""
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return None
        self.streak = 1 if uptime_s >= self.stable_s else self.streak + 1
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (self.streak - 1))
        self.times.append(now)
        self.total += 1
        return Restart(at=now + delay, count=len(self.times))


def cap_message(name: str, kind: str, code: int | None, policy: RestartPolicy, tail: str, log: str) -> str:
    """Why the run stops: the service, its exit code, the cap, what is at risk, its last log lines."""
    return (
        f"asyncrlhf up: {name} exited with code {code} and was restarted {len(policy.times)} times in the "
        f"last {policy.window_s:.0f} s (launch.max_restarts={policy.max_restarts}, "
        f"launch.restart_window_s={policy.window_s:g}); the run stops. At risk: {AT_RISK.get(kind, kind)}.\n"
        f"Last lines of {log}:\n{tail}"
    )
