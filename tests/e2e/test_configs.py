"""Every shipped config (`configs/*.yaml`, globbed: a new one is covered by being there) starts through
`asyncrlhf up` in its real shape on the CPU, trains 2 steps, and the audit accounts for every group.

The real shape: the models a config names by hub id (policy, reward, gold) and its hub data sets load from an
offline hub (tests/offline_hub.py: `HF_HUB_OFFLINE=1`, a cache laid out as the hub's clients leave it,
holding tiny stand-ins under the same ids); the packaged model is a stand-in of its tokenizer; the stages a
config starts from (its SFT warm start, its reward model) run first as `asyncrlhf` runs them. Only sizes
change (SIZES). The evaluator runs where the gold reward is a model (so the gold loads by hub id too). A
config that needs CUDA lists, in CPU_SHAPE, exactly the keys its CPU shape overrides and why.

Every run writes under the test's directory (`run.dir`). All configs share the session's Redis
(`redis.url`), so no run starts its own. Over 60 s for several configs, because each is a whole run: 3-4
processes that import torch start, 2 steps train and the audit reads them back (25-50 s on 2 cores); a
config that starts from its own SFT or reward model runs those stages first (tools_calculator, pipeline_full:
90-100 s), and vLLM's CPU build adds its engine's start (tldr, gsm8k, alpacafarm_lora_ppo: 100-140 s;
node4gpu, with the engine in a process of its own and 3 learner ranks: about 140 s). The configs without
vLLM run two at a time (`side_by_side`: a third less time on 2 cores than one after another); the vLLM
configs run last (`vllm`), one at a time. Building the offline hub (the module's fixture) takes about 20 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrlhf.config import Config, load_config
from asyncrlhf.model_sources import PACKAGED_MODELS, _looks_like_hub_name
from asyncrlhf.stages.common import run_path
from tests.offline_hub import COMMIT, StandIns, environment, question_rows, save_dataset

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
PACKAGED = "packaged-stand-in"

SIZES = ["learner.total_steps=2", "learner.checkpoint_every=2", "learner.groups_per_step=2",
         "generator.batch_prompts=2", "generator.sampling.max_new_tokens=8", "evaluator.num_prompts=2",
         "evaluator.max_new_tokens=8", "evaluator.batch_size=2", "sft.num_prompts=2", "sft.best_of_n=2"]

# What a config that needs CUDA overrides on the CPU, key by key, with the reason.
THREE_RANKS = ("1", "its 3 learner ranks are the node's GPUs 1-3 (node4gpu's CPU shape runs 3 ranks)")
CPU_SHAPE: dict[str, dict[str, tuple[str, str]]] = {
    "tldr": {"launch.learner_procs": THREE_RANKS},
    "alpacafarm_lora_ppo": {"launch.learner_procs": THREE_RANKS},
    "gsm8k": {"launch.learner_procs": THREE_RANKS},
    "node4gpu": {
        "generator.device": ("cpu", "cuda"),
        "generator.grpc_port": ("0", "a fixed port: another run may hold it on a shared CI machine"),
        "generator.vllm.engine_in_process": ("false", "the GPU default (on the CPU it is true): the engine "
                                             "in a process of its own"),
    },
}


def hub_ids(cfg: Config) -> dict[str, str]:
    """The hub ids a config names, with the role of each (`policy`, or `scorer` for reward and gold)."""
    named = {cfg.model.name_or_path: "policy"}
    for sc in [*cfg.reward.scorers, cfg.evaluator.gold]:
        if sc.kind == "model":
            named.setdefault(sc.path, "scorer")
    return {name: role for name, role in named.items()
            if _looks_like_hub_name(name) and not (ROOT / name).exists() and not Path(name).exists()}


def needs_vllm(name: str) -> bool:
    return load_config([ROOT / "configs" / f"{name}.yaml"]).generator.backend == "vllm"


@pytest.fixture(scope="session")
def offline_hub(tmp_path_factory) -> dict[str, str]:
    """One offline hub holding every config's hub models and data sets; its environment, and the packaged
    model's stand-in directory under PACKAGED. Built once for the session: the vLLM configs run at its end
    (tests/conftest.py), after other modules, where a module's fixture would be built a second time."""
    home = tmp_path_factory.mktemp("hf")
    stand_ins = StandIns(home)
    for name in CONFIGS:
        cfg = load_config([ROOT / "configs" / f"{name}.yaml"])
        for repo_id, role in hub_ids(cfg).items():
            if not (home / "hub" / f"models--{repo_id.replace('/', '--')}").exists():
                stand_ins.save(repo_id, role)
        task = cfg.task
        if task.name == "hf" and task.dataset and _looks_like_hub_name(task.dataset):
            fields = [f for f in (task.prompt_field, task.reference_field) if f]
            splits = {s: question_rows(fields) for s in (task.split, task.eval_split) if s}
            save_dataset(home, task.dataset, task.subset, splits)
    packaged = home / PACKAGED
    stand_ins.write(packaged, next(iter(PACKAGED_MODELS)), "policy")
    return {**environment(home), PACKAGED: str(packaged)}


def cpu_shape(name: str, cfg: Config, packaged: str) -> list[str]:
    """The overrides of `name`'s CPU shape: sizes, the packaged model's stand-in, the evaluator where the
    gold is a model, and CPU_SHAPE's keys."""
    overrides = list(SIZES)
    if cfg.model.name_or_path in PACKAGED_MODELS:
        overrides.append(f"model.name_or_path={packaged}")
    if cfg.sft.base in PACKAGED_MODELS:
        overrides.append(f"sft.base={packaged}")
    overrides.append(f"launch.evaluator={str(cfg.evaluator.gold.kind == 'model').lower()}")
    overrides += [f"{key}={value}" for key, (value, _) in CPU_SHAPE.get(name, {}).items()]
    return overrides


def stages_first(cfg: Config, workdir: Path) -> list[str]:
    """The stages whose outputs this config's `up` (run in `workdir`) starts from: its SFT warm start, its
    reward model."""
    stages = []
    if (workdir / cfg.model.name_or_path).resolve() == run_path(cfg, cfg.sft.output).resolve():
        stages.append("sft")
    rm = run_path(cfg, cfg.rm.output).resolve()
    if any(s.kind == "model" and (workdir / s.path).resolve() == rm for s in cfg.reward.scorers):
        stages += ["relabel", "train-rm"] if cfg.rm.data is None else ["train-rm"]
    return stages


def asyncrlhf(workdir: Path, env: dict[str, str], *args: str, timeout: float) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "asyncrlhf.cli", *args], cwd=workdir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def check_verifiers(run: Path, summary: dict) -> None:
    generator = summary["final_metrics"]["generator-0"]
    turns, episodes = (generator[f"asyncrlhf_generator_episode_turns_{k}"] for k in ("sum", "count"))
    assert episodes >= 8 and turns >= episodes, generator  # 2 steps of 2 groups of 2 episodes at least
    log = (run / "logs" / "generator-0.log").read_text()
    assert "verifiers environment asyncrlhf.envs.vf_arithmetic loaded (ToolEnv" in log


def check_pushes_reach_the_engine_process(run: Path, summary: dict) -> None:
    """The 4-GPU node's shape: the engine in a process of its own, each version handed to it in shared
    memory from the learner's host (the same host), never falling back to the stream."""
    learner_log = (run / "logs" / "learner.log").read_text(errors="replace")
    route = re.search(r"versions reach \S+ over the shm route from version 1\n", learner_log)
    assert route, learner_log[-3000:]
    assert "over the stream route" not in learner_log


# What a config is for, checked on its run besides the steps and the audit.
CHECKS: dict[str, Callable[[Path, dict], None]] = {
    "verifiers_arithmetic": check_verifiers,
    "node4gpu": check_pushes_reach_the_engine_process,
}


@pytest.fixture(scope="module")
def side_by_side(request, offline_hub, redis_url, tmp_path_factory) -> Iterator[dict[str, Future[None]]]:
    """The selected configs without vLLM, run two at a time from the module's first test on (each result
    is its own test's): a run leaves a core idle for much of its length (its services' starts, the launcher's
    polls, the last evaluation, the stop, the report's plots), which the other run takes. The vLLM configs
    run one at a time, in their own tests: the engine's CPU worker binds its threads to the cores."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and "vllm" not in item.keywords]
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="config")
    try:
        yield {name: pool.submit(start_in_real_shape, name, offline_hub, redis_url,
                                 tmp_path_factory.mktemp(f"config-{name}")) for name in selected}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.vllm] if needs_vllm(n) else [])
                                  for n in CONFIGS])
def test_the_config_starts_in_its_real_shape_and_trains_with_a_clean_audit(name, request, offline_hub,
                                                                            redis_url, tmp_path):
    """Over 60 s for most configs because each is a whole run (the module's docstring gives the figures):
    its services start, train 2 steps and stop, its stages run first, and a vLLM config starts an engine."""
    if "vllm" in request.node.keywords:
        start_in_real_shape(name, offline_hub, redis_url, tmp_path)
    else:
        request.getfixturevalue("side_by_side")[name].result()  # raises what the run's checks raised


def start_in_real_shape(name: str, offline_hub: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           **{k: v for k, v in offline_hub.items() if k != PACKAGED}}
    config = f"configs/{name}.yaml"
    cfg = load_config([ROOT / config])
    overrides = [*cpu_shape(name, cfg, offline_hub[PACKAGED]), f"run.dir={tmp_path}/runs/{{name}}"]
    for stage in stages_first(load_config([ROOT / config], overrides), tmp_path):
        code, out = asyncrlhf(tmp_path, env, stage, config, *overrides, timeout=300)
        assert code == 0, f"asyncrlhf {stage}:\n{out[-4000:]}"
    code, out = asyncrlhf(tmp_path, env, "up", config, *overrides, f"redis.url={redis_url}", timeout=600)
    assert code == 0, out[-4000:]
    run = tmp_path / "runs" / cfg.run.name
    summary = json.loads((run / "up_summary.json").read_text())
    assert summary["learner_version"] == 3  # two steps
    code, audit = asyncrlhf(tmp_path, env, "audit", str(run), "--json", timeout=300)
    assert code == 0, audit[-4000:]
    verdict = json.loads(audit)
    assert verdict["updates_lost"] == [] and verdict["trained_twice"] == [] and verdict["lost"] == []
    names = hub_ids(cfg)
    if cfg.model.name_or_path in names:  # the policy by hub id, its commit recorded with the checkpoint
        saved = load_config([run / "checkpoints" / "step-000003" / "config.yaml"])
        assert saved.model.revision == COMMIT
    if cfg.evaluator.gold.kind == "model":  # the gold model scored the initial policy and the last step
        rows = [json.loads(line) for line in (run / "eval" / "results.jsonl").read_text().splitlines()]
        assert [r["version"] for r in rows] == [1, 3], rows
    CHECKS.get(name, lambda run, summary: None)(run, summary)
