"""`python -m asyncrlhf.stages.pipeline --config configs/pipeline_full.yaml [--fresh] [overrides]`: the seed's
whole workflow, one stage after another, each its own process (memory is returned between stages):

    sft -> relabel -> train-rm -> up (online RL against the proxy RM, gold evaluation alongside) -> report

Every stage gets the same config files and overrides. Stage timings go to `<run.dir>/pipeline.json`; the
first failing stage stops the pipeline with its exit code. `--fresh` deletes the run directory first (the
learner would otherwise resume from its checkpoints).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from asyncrlhf.config import ConfigError
from asyncrlhf.service import load_service_config

STAGES = ("sft", "relabel", "train-rm", "up")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    fresh = "--fresh" in args
    args = [a for a in args if a != "--fresh"]
    try:
        cfg = load_service_config(args)
    except ConfigError as err:
        print(f"asyncrlhf pipeline: {err}", file=sys.stderr)
        return 2
    run_dir = cfg.run.path
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    timings: dict[str, float] = {}
    started = time.time()
    for stage in STAGES:
        print(f"== asyncrlhf {stage}", flush=True)
        t0 = time.time()
        code = subprocess.call([sys.executable, "-m", "asyncrlhf.cli", stage, *args])
        timings[stage] = round(time.time() - t0, 1)
        if code != 0:
            print(f"asyncrlhf pipeline: stage `{stage}` failed with exit code {code}", file=sys.stderr)
            return code
    from asyncrlhf.report import headline, write_report

    write_report(run_dir)
    summary = {"stages_s": timings, "total_s": round(time.time() - started, 1), **headline(run_dir)}
    (run_dir / "pipeline.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
