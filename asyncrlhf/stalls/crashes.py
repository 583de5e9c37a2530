"""Why a supervised process exited, read from its log: for `asyncrlhf up` to name, in a stall, a service that
exits before it answers (a generator whose engine cannot start, a reward replica with a rule that does not
exist) and why, rather than only that too few replicas are alive.

The log of one run of the process is read (the launcher appends every run to one file). The reason is the
first exception it names, where the root cause usually is (vLLM logs its workers' errors before the engine's
and the generator's own), and the last one, what the process died of, when they differ.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# `ValueError: ...`, `mcp.shared.exceptions.MCPError: ...`, also behind a logger's prefix
_EXCEPTION = re.compile(r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)")
MOST_CHARS = 300  # of each exception's message
MOST_BYTES = 1 << 20  # of a run's log read


def last_run(log_path: Path, offset: int) -> str:
    """The output of the run whose log begins at `offset` of `log_path` (its last `MOST_BYTES`)."""
    if not log_path.exists():
        return ""
    with log_path.open("rb") as log:
        log.seek(max(offset, log.seek(0, os.SEEK_END) - MOST_BYTES))
        return log.read().decode(errors="replace")


def reason(log: str) -> str:
    """Why the run that wrote `log` ended (see the module); its last line when it names no exception; ""
    when it is empty."""
    found: list[str] = []
    for line in log.splitlines():
        match = _EXCEPTION.search(line)
        if match:
            text = f"{match.group(1)}: {match.group(2).strip()}"
            if text not in found:
                found.append(text)
    if not found:
        lines = [line.strip() for line in log.splitlines() if line.strip()]
        return _cut(lines[-1]) if lines else ""
    return "; ".join(_cut(text) for text in ([found[0]] if len(found) == 1 else [found[0], found[-1]]))


def _cut(text: str) -> str:
    return text if len(text) <= MOST_CHARS else text[:MOST_CHARS - 3] + "..."


def exit_note(code: int, uptime_s: float, restarts: int, window_s: float, why: str) -> str:
    """How a stall names a service that exited: its code, how long it ran, its restarts, why."""
    return (f"exited with code {code} {uptime_s:.0f} s after its start (restarts in the last {window_s:g} s: "
            f"{restarts}): {why or 'its log says nothing'}")
