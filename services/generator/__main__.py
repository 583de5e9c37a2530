"""`python -m services.generator --config X [overrides]` (also `asyncrlhf generator --config X`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def _serve(cfg, log, stop) -> int:
    from services.generator.run import GeneratorService

    service = GeneratorService(cfg).start()
    try:
        service.run(stop)
    finally:
        service.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrlhf.service import run_service

    return run_service(_serve, list(sys.argv[1:] if argv is None else argv), "generator")


if __name__ == "__main__":
    sys.exit(main())
