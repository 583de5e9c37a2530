"""`python -m services.reward --config X [overrides]` (also `asyncrlhf reward ...`): one reward replica."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrlhf.service import run_service
from services.reward.loop import serve


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(serve, sys.argv[1:] if argv is None else argv, "reward")


if __name__ == "__main__":
    sys.exit(main())
