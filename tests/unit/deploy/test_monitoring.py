"""deploy/prometheus and deploy/grafana, statically: `promtool check config` / `check rules` pass, every
metric an alert or a panel names is one `asyncrlhf.metrics` names and a service declares (and the services
declare exactly the names it holds), every alert has the `<signal> <cmp> <threshold>` shape the live test
relies on, and the dashboard is well-formed against its provisioned data source."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from asyncrlhf import metrics
from tests.unit.deploy.helpers import (
    DASHBOARD,
    DEPLOY,
    Query,
    alert_rules,
    alert_signal,
    dashboard_queries,
    declared_families,
    declared_metrics,
    metric_names,
)

pytestmark = pytest.mark.unit
PROMETHEUS = DEPLOY / "prometheus"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus; .ci/run does)"
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["promtool", "check", *args], check=False, capture_output=True, text=True, cwd=PROMETHEUS, timeout=60
    )


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_promtool_check_config(config):
    out = promtool("config", config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr, "the config must load alerts.yml"


@needs_promtool
def test_promtool_check_rules():
    out = promtool("rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


@needs_promtool
def test_the_stall_alerts_fire_and_name_the_hop_and_the_evidence():
    """deploy/prometheus/alerts.test.yml: a stall at the generators, a frozen learner (promtool's unit tests,
    which expand the annotations' queries against the series the test gives)."""
    out = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], check=False, capture_output=True,
                         text=True, cwd=PROMETHEUS, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
def test_promtool_rejects_a_broken_rule(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "rate(up[5m]"}]}]})
    )
    assert promtool("rules", str(broken)).returncode != 0


def test_the_alerts_cover_the_failure_modes_the_issue_names():
    names = {rule["alert"] for rule in alert_rules()}
    assert names == {
        "AsyncrlhfStalenessAboveMax",
        "AsyncrlhfGeneratorVersionLagging",
        "AsyncrlhfGeneratorDown",
        "AsyncrlhfQueueBacklogGrowing",
        "AsyncrlhfLearnerStalled",
        "AsyncrlhfLearnerDown",
        "AsyncrlhfDeadLetters",
    }
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert alert_signal(rule["expr"])  # the shape the live test evaluates


def test_alert_signal_strips_only_the_top_level_comparison():
    assert alert_signal('up{service="generator"} == 0') == 'up{service="generator"}'
    assert alert_signal('scalar(max(a)) - b{x=~"y>1"} > 1') == 'scalar(max(a)) - b{x=~"y>1"}'
    assert (
        alert_signal("histogram_quantile(0.95, sum by (le) (rate(h[5m]))) >= 2")
        == "histogram_quantile(0.95, sum by (le) (rate(h[5m])))"
    )
    with pytest.raises(ValueError):
        alert_signal("a > 1 and b < 2")


def test_every_metric_in_the_dashboard_and_the_alerts_is_named_in_asyncrlhf_metrics_and_declared():
    """The JSON and YAML cannot import the names: each must be one of `asyncrlhf.metrics` (a histogram's
    samples add `_bucket`, `_count` or `_sum`) and a sample some service exports."""
    declared, missing = declared_metrics()
    queries = dashboard_queries() + [Query(f"alert `{r['alert']}`", r["expr"]) for r in alert_rules()]
    unknown = {}
    for query in queries:
        for name in metric_names(query.expr):
            named = name in metrics.NAMES or re.sub(r"_(bucket|count|sum)$", "", name) in metrics.NAMES
            if not named or (name not in declared and name.split("_")[1] not in missing):
                unknown.setdefault(name, []).append(query.where)
    assert not unknown, f"metrics asyncrlhf.metrics does not name or no service declares: {unknown}"


def test_the_services_declare_exactly_the_metrics_asyncrlhf_metrics_names():
    """`asyncrlhf.metrics` is the one owner of metric names: no service declares another, none is stale."""
    families, missing = declared_families()
    assert not missing
    assert set(families) == metrics.NAMES


def test_dashboard_panels_are_well_formed_against_the_provisioned_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = datasource["datasources"][0]["uid"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        here = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not here & cells, f"panel `{panel['title']}` overlaps another"
        cells |= here
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == uid
        assert panel["targets"], f"panel `{panel['title']}` has no query"
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in (
        "tokens/s per generator",
        "groups/s",
        "queue depth",
        "heatmap",
        "p50 / p95",
        "policy version per generator",
        "push duration",
        "push bytes",
        "reward",
        "kl",
        "loss",
        "gold reward",
        "win rate",
        "idle and wait",
        "judge calls",
        "judged win rate",
        "training-inference mismatch",
    ):
        assert topic in titles, f"the dashboard has no panel on {topic}"
