"""Loading a config: defaults <- YAML file(s) <- CLI overrides, each key checked (`keys`), then validated;
every failure is a `ConfigError` naming the dotted key."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from asyncrlhf.config.base import ConfigError
from asyncrlhf.config.keys import check_keys, key_path
from asyncrlhf.config.tree import Config


def load_config(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """Resolve defaults <- each YAML file in order <- overrides (`a.b=v` or `--a.b v`)."""
    data: dict[str, Any] = {}
    for file in files:
        _deep_merge(data, _read_yaml(Path(file)))
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    check_keys(data, Config)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`["learner.lr=1e-6", "--run.name", "x", "--learner.lora.enabled=true"]` -> [(path, value), ...]."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif arg.startswith("--") and i + 1 < len(args):
            raw = args[i + 1]
            i += 2
        else:
            raise ConfigError(f"override `{arg}` has no value; write `{key}=VALUE` or `--{key} VALUE`")
        if not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"override `{arg}`: expected a dotted key such as `learner.lr`")
        pairs.append((key, _parse_scalar(raw)))
    return pairs


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _parse_scalar(raw: str) -> Any:
    if _FLOAT.match(raw) and not raw.lstrip("+-").isdigit():
        return float(raw)  # YAML 1.1 reads `1e-6` as a string; users mean a number
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override `{dotted}`: `{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path, field = key_path(e["loc"], Config)
        what = f": {field.description}" if e["type"] == "missing" and field and field.description else ""
        # A whole section as the input says nothing the message does not, and may hold a password.
        got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
        lines.append(f"`{path}`: {e['msg']}{what}{got}")
    return "invalid config: " + "; ".join(lines)
