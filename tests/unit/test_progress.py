"""The progress display of `asyncrlhf up` shows the time to the learner's first trained step."""

import pytest

from asyncrlhf import metrics as names
from asyncrlhf.launcher import Progress, Snapshot

pytestmark = pytest.mark.unit


def test_first_step_time_is_shown_once_the_learner_has_stepped(capsys):
    progress = Progress(total_steps=10, started=0.0)  # `up` started at monotonic time 0: long ago
    progress.update(Snapshot(values={names.LEARNER_STEPS_TOTAL: 0.0}))
    assert dict(progress.rows(Snapshot()))["first step"] == "-"
    progress.update(Snapshot(values={names.LEARNER_STEPS_TOTAL: 1.0}))
    first = progress.first_step_s
    assert first is not None and first > 0
    progress.update(Snapshot(values={names.LEARNER_STEPS_TOTAL: 2.0}))
    assert progress.first_step_s == first  # the first step, not the latest
    assert dict(progress.rows(Snapshot()))["first step"] == f"{first:.0f}s"
    assert capsys.readouterr().out.count("first trained step") == 1
