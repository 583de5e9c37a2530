"""`asyncrlhf config show CONFIG... [overrides]`: print the resolved YAML and its hash."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrlhf.config import ConfigError, load_config


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Leading `*.yaml`/`*.yml` paths (or `--config PATH`) are files; the rest are overrides."""
    files: list[str] = []
    rest: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args):
            files.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
        elif not rest and "=" not in arg and arg.endswith((".yaml", ".yml")):
            files.append(arg)
        else:
            rest.append(arg)
        i += 1
    return files, rest


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "show":
        print("usage: asyncrlhf config show CONFIG.yaml [key=value | --key value ...]", file=sys.stderr)
        return 2
    files, overrides = split_config_args(argv[1:])
    try:
        config = load_config(files, overrides)
    except ConfigError as err:
        print(f"asyncrlhf: {err}", file=sys.stderr)
        return 2
    print(f"# config hash: {config.hash()}")
    print(config.to_yaml(), end="")
    return 0
