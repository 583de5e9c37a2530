"""The `asyncrlhf up` display on rich's recording console: unknown values read `–`, the last known values
stay after a service exits, and the final frame is the final state."""

import time

import pytest
from rich.console import Console

from asyncrlhf import metrics as names
from asyncrlhf.progress import Progress, rows
from asyncrlhf.scrape import Snapshot
from asyncrlhf.stalls import Hop, Stall

pytestmark = pytest.mark.unit
TOTAL = 1500


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def snapshot(learner=None, generator=None, evaluator=None):
    """Learner / generator / evaluator metrics; a service given as None did not answer (exited)."""
    snap = Snapshot()
    for name, values in (("learner", learner), ("generator-0", generator), ("evaluator", evaluator)):
        snap.answered[name] = values is not None
        if values is None:
            continue
        own = {k: v for k, v in values.items() if k != "version"}
        snap.per_service[name] = own
        for key, value in own.items():
            snap.values[key] = snap.values.get(key, 0.0) + value
        if name.startswith("generator"):
            snap.generator_versions[name] = values["version"]
    return snap


def learner_at(step, reward=0.25, kl=-0.02):
    return {names.LEARNER_STEPS_TOTAL: step, names.LEARNER_VERSION: step + 1,
            names.LEARNER_REWARD_MEAN: reward, names.LEARNER_KL: kl,
            f"{names.LEARNER_STALENESS_VERSIONS}_count": 4.0 * step,
            f"{names.LEARNER_STALENESS_VERSIONS}_sum": 2.0 * step}


def frames(console) -> list[str]:
    text = console.export_text()
    return ["asyncrlhf up" + part for part in text.split("asyncrlhf up")[1:]]


def display(clock):
    console = Console(record=True, width=120, force_terminal=True, color_system=None)
    return Progress(TOTAL, console=console, clock=clock), console


def test_before_anything_is_known_every_value_reads_a_dash():
    clock = Clock()
    progress, console = display(clock)
    progress.update(snapshot(learner={names.LEARNER_STEPS_TOTAL: 0.0, names.LEARNER_VERSION: 1.0},
                             generator={"version": 0.0}, evaluator={names.EVALUATOR_GOLD_REWARD: 0.0,
                                                                    names.EVALUATOR_EVALUATIONS_TOTAL: 0.0}))
    progress.close()
    last = frames(console)[-1]
    assert "step" in last and "0/1500" in last
    for row in ("reward", "gold", "staleness"):
        assert next(line for line in last.splitlines() if row in line).rstrip(" │").endswith("–"), row
    assert "nan" not in last and "0.000" not in last  # no made-up values
    assert "– steps/s, eta –, first step after –" in last


def test_the_final_frame_keeps_the_last_known_values_after_the_services_exit():
    clock = Clock()
    progress, console = display(clock)
    progress.update(snapshot(learner=learner_at(0), generator={"version": 1.0}))
    clock.now += 30  # model loading: the first step comes 30 s in
    progress.update(snapshot(learner=learner_at(1), generator={"version": 2.0}))
    clock.now += 1499 / 2  # 2 steps/s from then on
    evaluator = {names.EVALUATOR_GOLD_REWARD: 0.42, names.EVALUATOR_EVALUATIONS_TOTAL: 3.0}
    progress.update(snapshot(learner=learner_at(1500, reward=0.75, kl=0.031), generator={"version": 1501.0},
                             evaluator=evaluator))
    clock.now += 5
    progress.update(snapshot())  # the learner, generators and evaluator have exited: nothing answers
    progress.close()
    last = frames(console)[-1]
    assert "1500/1500" in last and "learner 1501, generators 1501" in last
    # reward, kl, gold, staleness (2 versions summed over 4 samples per step)
    assert "0.750" in last and "0.0310" in last and "0.420" in last and "0.50" in last
    assert "2.00 steps/s, eta 0s, first step after 30s" in last
    assert "kl (k1 est., may be < 0)" in last


def test_steps_taken_after_the_last_scrape_come_from_the_final_checkpoint():
    clock = Clock()
    console = Console(record=True, width=120, force_terminal=True, color_system=None)
    progress = Progress(30, console=console, clock=clock, final_version=lambda: 31)
    progress.update(snapshot(learner=learner_at(28, reward=0.5), generator={"version": 29.0}))
    progress.update(snapshot(generator={"version": 31.0}))  # the learner stepped twice more, then exited
    progress.close()
    last = frames(console)[-1]
    assert "30/30" in last and "learner 31, generators 31" in last
    assert "0.500 (step 28)" in last  # the last reward known, and from which step


def test_without_a_terminal_it_logs_lines_and_a_final_one(capsys):
    clock = Clock()
    progress = Progress(TOTAL, clock=clock)
    progress.update(snapshot(learner=learner_at(3)))
    clock.now += 1
    progress.update(snapshot())  # within 10 s: no line
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("progress: step=3/1500") for line in lines)


def test_the_generator_backend_and_why_auto_chose_it_are_shown():
    console = Console(record=True, width=160, force_terminal=True, color_system=None)
    progress = Progress(TOTAL, console=console, clock=Clock(),
                        generator="hf (auto: vLLM is not installed)")
    progress.close()
    line = next(line for line in frames(console)[-1].splitlines() if "generator" in line)
    assert "hf (auto: vLLM is not installed)" in line



def test_the_learner_s_wait_and_then_its_stall_are_shown():
    clock = Clock()
    progress, console = display(clock)
    snap = snapshot(learner=learner_at(3))
    snap.waiting["learner"] = ("scored_groups", time.time() - 75)
    progress.update(snap)
    assert dict(rows(progress.state))["learner waits on"] == "scored_groups for 1m15s"
    clock.now += 5
    progress.update(snapshot(learner=None))
    assert progress.state.stepless_s() == 5.0 and progress.state.silent_s("learner") == 5.0
    progress.state.stall = Stall(Hop.LEARNER, "learner not stepping for 5 s: process alive but its metrics "
                                 "endpoint does not answer for 5 s", 5.0)
    progress.close()
    text = console.export_text()
    assert "STALLED" in text and "at learner: learner not stepping" in text, text
