"""The in-process baseline of `asyncrlhf bench pipeline`: the same RLHF work with no services.

One Python process, every core: sample the step's prompts with the library's backend (`generator.backend`,
its own copy of the model, as a generator holds one), score them with the library's reward, train one step
with the library's Trainer (DeepSpeed engine, same objective and settings), copy the new weights into the
backend (`apply_weights`, as a push would end), and checkpoint on the run's schedule in the run's layout,
so the bench scores its checkpoints with the same gold evaluation as the service runs. Synchronous and
on-policy by construction: what the services must beat. It is built as the learner is
(`asyncrlhf.learner.build_learner`), and its prompts are the learner feed's (`asyncrlhf.inbox.prompts`), in
the feed's order, `groups_per_step` a step.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

from asyncrlhf.config import Config, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.learner import build_learner
from asyncrlhf.rewards import build_reward
from asyncrlhf.rewards.groups import items_of, scored
from asyncrlhf.sampling import create_backend
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.training import checkpoint, engine
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.version import PolicyVersion

PHASES = ("generation", "scoring", "training", "push", "apply")
RESULT = "inprocess.json"


class InProcess:
    """Generate -> score -> train -> apply, step after step, in this process."""

    def __init__(self, cfg: Config):
        threads = os.cpu_count() or 1
        learner = cfg.learner.model_copy(update={"threads": threads})
        generator = cfg.generator.model_copy(update={"threads": threads})
        parts = build_learner(cfg.model_copy(update={"learner": learner, "generator": generator}))
        self.cfg = cfg = parts.cfg
        self.tokenizer, self.trainer = parts.tokenizer, parts.trainer
        self.policy, self.value = parts.models.policy, parts.models.value
        self.backend = create_backend(cfg, self.tokenizer)
        self.reward = build_reward(cfg.reward, cfg.model)
        self.prompts = parts.prompts
        self.state = checkpoint.LearnerState()
        self.seconds: dict[str, float] = defaultdict(float)
        self._cursor = 0
        self._apply(self.state.version)

    def _apply(self, version: int) -> None:
        """The policy's weights of `version` into the backend (what a push then its swap do)."""
        lc = self.cfg.learner
        started = time.perf_counter()
        weights = engine.full_state_dict(self.policy.module, lc.deepspeed.zero_stage, lc.lora.enabled)
        gathered = time.perf_counter()
        self.backend.apply_weights(weights, PolicyVersion(0, version))
        self.seconds["push"] += gathered - started
        self.seconds["apply"] += time.perf_counter() - gathered

    def step(self) -> dict[str, float]:
        g, lc = self.cfg.generator, self.cfg.learner
        prompts = [self.prompts.group(self._cursor + i, self.state.version)
                   for i in range(lc.groups_per_step)]
        self._cursor += len(prompts)
        started = time.perf_counter()
        completions = self.backend.generate([list(p.prompt_token_ids) for p in prompts],
                                            g.samples_per_prompt, g.sampling)
        generated = time.perf_counter()
        version = PolicyVersion(self.state.lineage, self.state.version)
        groups = [rollout_group(p, c, version, "inprocess", time.time(), time.time(), self.tokenizer.decode)
                  for p, c in zip(prompts, completions, strict=True)]
        result = self.reward.score([item for group in groups for item in items_of(group)])
        k = g.samples_per_prompt
        groups = [scored(group, result, i * k, "inprocess") for i, group in enumerate(groups)]
        scored_at = time.perf_counter()
        stats = self.trainer.train_step([TrainGroup(group) for group in groups],
                                        step_seed=self.cfg.run.seed + self.state.version)
        self.state.version += 1
        trained = time.perf_counter()
        self.seconds["generation"] += generated - started
        self.seconds["scoring"] += scored_at - generated
        self.seconds["training"] += trained - scored_at
        if self.state.steps % lc.sync_every == 0:
            self._apply(self.state.version)
        if self.state.steps % lc.checkpoint_every == 0 or self.state.steps == lc.total_steps:
            self.state.cursor = self.state.finished = self._cursor
            checkpoint.save(self.cfg, self.policy, self.value, self.tokenizer, self.state, None, rank=0)
        return stats

    def run(self) -> dict:
        """Train `learner.total_steps` steps; the run's timing as the pipeline bench reports it."""
        started = time.time()
        self.seconds.clear()  # start-up (model loads, the first copy of weights) is not a step
        step_at: dict[int, float] = {}
        while self.state.steps < self.cfg.learner.total_steps:
            self.step()
            step_at[self.state.version] = time.time()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        times = sorted(step_at.values())
        steps = len(times)
        return {
            "name": "inprocess", "cfg": self.cfg,
            "s_per_step": (times[-1] - times[0]) / max(1, steps - 1),
            "step_times": {version: at - started for version, at in step_at.items()},
            "breakdown": {phase: self.seconds[phase] / steps for phase in PHASES},
            "generator_idle_fraction": 0.0, "learner_wait_fraction": 0.0,
        }


def run_inprocess(files: Sequence[str], overrides: Sequence[str]) -> dict:
    """The baseline in a child process (its own threads, memory and DeepSpeed process group, as every
    service run has): `python -m asyncrlhf.bench.inprocess`, which writes `inprocess.json` in the run dir."""
    cfg = load_config(files, overrides)
    argv = [sys.executable, "-m", __name__, *(a for f in files for a in ("--config", f)), *overrides]
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    log = cfg.run.path / "inprocess.log"
    with log.open("w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the in-process run failed ({code}); see {log}")
    return {**json.loads((cfg.run.path / RESULT).read_text()), "cfg": cfg}


def main(argv: Sequence[str]) -> int:
    files, overrides = split_config_args(list(argv))
    cfg = load_config(files, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = InProcess(cfg).run()
    result.pop("cfg")
    (cfg.run.path / RESULT).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
