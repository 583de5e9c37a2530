import pytest

from asyncrlhf.config import TaskConfig
from asyncrlhf.envs.loading import calculator
from asyncrlhf.tasks import load_task

pytestmark = pytest.mark.unit


def test_the_arithmetic_task_carries_each_questions_answer():
    task = load_task(TaskConfig(name="arithmetic"))
    assert len(task.train) == 990 and len(task.eval) == 110
    for question, answer in zip(task.train[:50], task.train_references[:50], strict=True):
        expression = question.removeprefix("What is ").removesuffix("?")
        assert calculator(expression) == answer
