import json

import pytest

from asyncrlhf.chat_format import parse_tool_calls
from asyncrlhf.config import TaskConfig
from asyncrlhf.envs.loading import calculator
from asyncrlhf.tasks import load_task
from asyncrlhf.tasks.arithmetic import expression_of
from tools.gen_calculator_calls import SHIPPED, SHIPPED_ROWS, render

pytestmark = pytest.mark.unit


def test_the_arithmetic_task_carries_each_questions_answer():
    task = load_task(TaskConfig(name="arithmetic"))
    assert len(task.train) == 990 and len(task.eval) == 110
    for question, answer in zip(task.train[:50], task.train_references[:50], strict=True):
        expression = question.removeprefix("What is ").removesuffix("?")
        assert calculator(expression) == answer


def test_the_calculator_task_needs_the_tool_and_carries_its_answers():
    task = load_task(TaskConfig(name="calculator"))
    assert len(task.train) == 576 and len(task.eval) == 64
    assert not set(task.train) & set(task.eval)
    for question, answer in zip(task.eval, task.eval_references, strict=True):
        assert calculator(expression_of(question)) == answer
        assert int(answer) >= 12 * 12  # a two-digit product at least: beyond the demo model unaided


def test_the_shipped_calls_are_the_calculators_answers_to_train_questions():
    """configs/data/calculator_calls.jsonl is what tools/gen_calculator_calls.py writes, and each row's call
    parses (as the episodes parse it) to the calculator evaluating the question."""
    assert SHIPPED.read_text() == render(SHIPPED_ROWS)
    task = load_task(TaskConfig(name="calculator"))
    answers = dict(zip(task.train, task.train_references, strict=True))
    for line in SHIPPED.read_text().splitlines():
        row = json.loads(line)
        turn = parse_tool_calls(row["completion"])
        assert not turn.errors and turn.content == "" and [c.name for c in turn.calls] == ["calculator"]
        assert calculator(**turn.calls[0].arguments) == answers[row["prompt"]]
