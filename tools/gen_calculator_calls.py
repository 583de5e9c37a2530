"""Write the calculator tool-call demonstrations that the tool-use workload's warm start trains on
(`configs/tools_calculator.yaml`, `sft.data`): the first N train questions of the `calculator` task, each
with the call that answers it, one {prompt, completion} JSON object a line. Deterministic: rerunning it
rewrites the same file (a unit test checks the shipped one).

    python tools/gen_calculator_calls.py [--n 24] [--out configs/data/calculator_calls.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrlhf.tasks.arithmetic import calculator_calls

SHIPPED = Path("configs/data/calculator_calls.jsonl")
SHIPPED_ROWS = 24


def render(n: int) -> str:
    return "".join(json.dumps(row) + "\n" for row in calculator_calls(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SHIPPED_ROWS)
    parser.add_argument("--out", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.n))
    print(f"{args.n} calculator calls written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
