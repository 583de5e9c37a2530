"""An episode's end reason (`asyncrlhf.envs.base.EpisodeEnd`): one owner writes the text `Sample.episode_end`
carries and reads it back, and an environment's failure carries one."""

from __future__ import annotations

import pytest

from asyncrlhf.envs.base import EndKind, EnvFailure, EpisodeEnd
from asyncrlhf.envs.mcp_server import McpServerDown

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("end, text", [
    (EpisodeEnd(EndKind.DONE), "done"),
    (EpisodeEnd(EndKind.MAX_TURNS), "max_turns"),
    (EpisodeEnd(EndKind.TIMEOUT, "step ran past task.env.step_timeout_s=2"),
     "timeout: step ran past task.env.step_timeout_s=2"),
    # the detail may hold the separator itself: only the first one splits
    (EpisodeEnd(EndKind.ERROR, "step raised RuntimeError: the sandbox died"),
     "error: step raised RuntimeError: the sandbox died"),
])
def test_an_end_is_written_as_kind_and_detail_and_read_back(end, text):
    assert str(end) == text
    assert EpisodeEnd.parse(text) == end


@pytest.mark.parametrize("text", ["", "finished", "Done", "timeout:no space"])
def test_text_that_is_no_episodes_end_is_refused_naming_the_kinds(text):
    with pytest.raises(ValueError, match="is not an episode's end: one of done, max_turns, length, error"):
        EpisodeEnd.parse(text)


def test_an_environments_failure_carries_its_end():
    failure = EnvFailure.timeout("reset ran past task.env.step_timeout_s=1")
    assert failure.end == EpisodeEnd(EndKind.TIMEOUT, "reset ran past task.env.step_timeout_s=1")
    assert str(failure) == "timeout: reset ran past task.env.step_timeout_s=1"
    down = McpServerDown.error("the MCP server `calc` is down")
    assert isinstance(down, McpServerDown) and down.end.kind is EndKind.ERROR
    assert EnvFailure.malformed("step returned dict").end.kind is EndKind.MALFORMED
