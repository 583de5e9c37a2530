"""`asyncrlhf <command>`: one entry point for every service and offline stage.

Each command lives in its own module and exposes `main(argv) -> int`; it is imported only when run, so
`asyncrlhf config show` does not pay for torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "config": (
        "asyncrlhf.config_cli", "Show the resolved config: `asyncrlhf config show CONFIG [overrides]`."
    ),
    "up": ("asyncrlhf.launcher", "Start Redis and every service locally, with live progress."),
    "plan": ("asyncrlhf.planning", "Place every service on a GPU node and check that its memory fits."),
    "generator": ("services.generator.__main__", "Run a generator (HF or vLLM backend, WeightSync server)."),
    "reward": ("services.reward.__main__", "Run a reward scorer replica."),
    "learner": ("services.learner.__main__", "Run the DeepSpeed learner."),
    "evaluator": ("services.evaluator.__main__", "Run the checkpoint evaluator."),
    "sft": ("asyncrlhf.stages.sft", "Supervised fine-tuning."),
    "train-rm": ("asyncrlhf.stages.train_rm", "Bradley-Terry reward model training."),
    "relabel": ("asyncrlhf.stages.relabel", "Relabel preference pairs with the gold reward."),
    "generate": ("asyncrlhf.stages.generate", "Generate held-out completions from checkpoints."),
    "eval": ("asyncrlhf.stages.evaluate", "Score generations with the gold reward."),
    "pipeline": (
        "asyncrlhf.stages.pipeline", "The seed's workflow: SFT -> relabel -> train-rm -> up -> report."
    ),
    "report": ("asyncrlhf.report", "Write report.md and plots for a run directory."),
    "export": (
        "asyncrlhf.export", "Write a checkpoint as a Hugging Face model directory (load, serve, share)."
    ),
    "audit": (
        "asyncrlhf.audit", "Check that every enqueued group was trained once, dropped or dead-lettered."
    ),
    "bench": ("asyncrlhf.bench",
              "Benchmarks: transport, generator, pipeline, load, chaos, staleness, learner."),
}


# Commands that parse their own arguments (argparse or a usage of their own) answer `--help` themselves; the
# others take config files and overrides, where `--help` would read as an override without a value.
OWN_HELP = ("up", "plan", "report", "audit", "bench", "export")
CONFIG_ARGS = (
    "Config: one or more YAML files (`CONFIG.yaml` or `--config FILE`, later ones override earlier),\n"
    "then overrides as `key=value` or `--key value` (e.g. `learner.lr=1e-4`).\n"
    "`asyncrlhf config show CONFIG.yaml` prints every key with its resolved value."
)


def _command_help(name: str, module) -> str:
    doc = (module.__doc__ or "").strip()
    return f"asyncrlhf {name}: {COMMANDS[name][1]}\n\n{doc}\n\n{CONFIG_ARGS}" if doc else CONFIG_ARGS


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: asyncrlhf <command> [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"asyncrlhf: unknown command `{name}`\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            print(f"asyncrlhf: `{name}` is not built yet", file=sys.stderr)
            return 2
        raise
    if name not in OWN_HELP and {"-h", "--help"} & set(rest):
        print(_command_help(name, module))
        return 0
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
