"""`asyncrlhf evaluator --config X [overrides]` / `python -m services.evaluator --config X`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrlhf.service import run_service


def main(argv: Sequence[str] | None = None) -> int:
    from services.evaluator.loop import serve

    return run_service(serve, sys.argv[1:] if argv is None else argv, "evaluator")


if __name__ == "__main__":
    sys.exit(main())
