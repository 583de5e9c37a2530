"""The tools of an MCP server (the `mcp` SDK, over stdio) for `asyncrlhf.envs.tools.ToolEnv`: the server as a
subprocess, one session with it, its health checked around every call and the server started again when it
stopped answering (`McpServer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrlhf.chat_format import ToolSpec
from asyncrlhf.envs.base import EnvFailure
from asyncrlhf.envs.tools import Tool

log = logging.getLogger(__name__)


class McpServerDown(EnvFailure):
    """The MCP server stopped answering (its process died or hung): the episode whose call found it ends with
    this reason, and the server is started again for the episodes after it."""


class McpServer:
    """An MCP server started as a subprocess (`command`), one session held open by one task on an event loop
    of its own thread (the SDK's contexts must be entered and left by the same task): its tools, callable
    from any thread.

    Its health is checked around every call. A call that fails outright (not a tool's own error, which the
    model sees as the tool's result) is followed by a ping: a server that answers it had refused that call
    (the model sees the error); one that does not is down, and it is started again (its old process ended)
    while the call raises `McpServerDown`, so an episode never goes on with a dead server's errors as its
    observations. Before a call, a server whose restart failed is tried again (at most every
    `RESTART_EVERY_S`); until one succeeds, calls raise `McpServerDown` at once."""

    PING_S = 5.0  # a live server answers a ping within this long
    RESTART_EVERY_S = 5.0

    def __init__(self, command: Sequence[str], timeout_s: float = 30.0):
        if not command:
            raise ValueError("an MCP server needs a command, e.g. [python, my_server.py]")
        self.command, self.timeout_s = list(command), timeout_s
        self.name = " ".join(self.command)
        self.restarts = 0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True).start()
        self._lock = threading.Lock()
        self._session: Any = None
        self._closing = asyncio.Event()
        self._served: concurrent.futures.Future | None = None
        self._down_since, self._why_down = 0.0, ""
        self._open()

    def _open(self) -> None:
        """Start the server and open a session with it (raises when it does not come up in `timeout_s`)."""
        opened: concurrent.futures.Future = concurrent.futures.Future()
        self._closing = asyncio.Event()
        self._served = asyncio.run_coroutine_threadsafe(self._serve(opened, self._closing), self._loop)
        self._session = opened.result(self.timeout_s)

    async def _serve(self, opened: concurrent.futures.Future, closing: asyncio.Event) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        try:
            params = StdioServerParameters(command=self.command[0], args=self.command[1:])
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                opened.set_result(session)
                await closing.wait()
        except Exception as err:
            if not opened.done():
                opened.set_exception(err)
            raise

    def _run(self, coroutine, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def tools(self) -> list[Tool]:
        listed = self._run(self._current().list_tools(), self.timeout_s)
        return [Tool(ToolSpec(t.name, t.description or "", t.input_schema), self._caller(t.name))
                for t in listed.tools]

    def _caller(self, name: str) -> Callable[[dict[str, Any]], str]:
        def call(arguments: dict[str, Any]) -> str:
            session = self._current()
            try:
                result = self._run(session.call_tool(name, arguments), self.timeout_s)
            except Exception as err:
                if not self._answers(session):
                    self._down(session, f"`{name}` got {type(err).__name__}: {err}")
                raise
            text = "\n".join(getattr(block, "text", "") for block in result.content)
            if result.is_error:
                raise RuntimeError(text or f"the MCP tool `{name}` failed")
            return text

        return call

    def _answers(self, session: Any) -> bool:
        try:
            self._run(session.send_ping(), min(self.PING_S, self.timeout_s))
        except Exception:  # closed, broken or silent: down, whatever the SDK raised
            return False
        return True

    def _current(self) -> Any:
        """The live session; a server whose restart failed is tried again first (raises `McpServerDown`)."""
        with self._lock:
            if self._session is None and time.monotonic() - self._down_since >= self.RESTART_EVERY_S:
                self._restart()
            if self._session is None:
                raise McpServerDown.error(f"the MCP server `{self.name}` is down "
                                    f"({self._why_down}); this episode ends")
            return self._session

    def _down(self, session: Any, why: str) -> None:
        """`session`'s server stopped answering: start it again (unless another call already did), and end
        the calling episode."""
        with self._lock:
            if session is self._session:
                self._why_down = f"it stopped answering: {why}"
                log.warning("the MCP server `%s` %s; starting it again", self.name, self._why_down)
                self._restart()
            outcome = "started again" if self._session is not None else f"not started again: {self._why_down}"
        raise McpServerDown.error(f"the MCP server `{self.name}` stopped answering ({why}); "
                            f"{outcome}; this episode ends")

    def _restart(self) -> None:
        """(Under the lock.) End the old session and process, start a new one; on failure the server stays
        down until the next try."""
        self._loop.call_soon_threadsafe(self._closing.set)
        self._session = None
        try:
            self._open()
        except Exception as err:  # whatever stops the server from starting, it stays down
            self._down_since = time.monotonic()
            self._why_down = f"it did not start: {type(err).__name__}: {err}"
            log.warning("the MCP server `%s` %s", self.name, self._why_down)
            return
        self.restarts += 1

    def close(self) -> None:
        """End the session and the server's process, then the loop."""
        self._loop.call_soon_threadsafe(self._closing.set)
        try:
            if self._served is not None:
                self._served.result(self.timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
