"""`asyncrlhf bench NAME [args]`: benchmarks that print ratios measured side by side in one run.

Each benchmark is a module `asyncrlhf.bench.<name>` with `main(argv) -> int`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHMARKS = ("transport", "generator", "pipeline", "load", "chaos", "staleness", "learner",
              "dynamic", "judge", "mismatch")


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: asyncrlhf bench {{{','.join(BENCHMARKS)}}} [args]", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"asyncrlhf.bench.{argv[0]}")
    except ModuleNotFoundError:
        print(f"asyncrlhf: benchmark `{argv[0]}` is not built yet", file=sys.stderr)
        return 2
    return int(module.main(list(argv[1:])) or 0)
