"""A small server of OpenEnv's WebSocket protocol (what openenv-core 0.3's `HTTPEnvServer` serves on /ws,
message for message), for the OpenEnv adapter's tests: one `Guess` environment per session.

Guess: the secret is 7 (or reset's `seed`); the model's turn (the action's `message`) is right when it holds
the secret: done, reward 1; else "Wrong, try again." A reset prompt holding a cue makes the session fail at
its first step: "boom" answers an error, "hang" never answers, "junk" answers text that is not JSON, "drop"
closes the connection, "odd" answers an observation without reward and done types."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

app = FastAPI()
SESSIONS = {"open": 0, "closed": 0}


@app.get("/health")
def health() -> dict:
    return {"status": "healthy"}


def observation(text: str, reward: float | None = None, done: bool = False) -> str:
    fields = {"prompt": text, "round": 1, "hint": "a whole number"}
    data = {"observation": fields, "reward": reward, "done": done}
    return json.dumps({"type": "observation", "data": data})


@app.websocket("/ws")
async def session(ws: WebSocket) -> None:
    await ws.accept()
    SESSIONS["open"] += 1
    secret, cue = 7, ""
    try:
        while True:
            message = json.loads(await ws.receive_text())
            kind, data = message.get("type"), message.get("data", {})
            if kind == "close":
                break
            if kind == "reset":
                secret, cue = int(data.get("seed", 7)), data.get("prompt", "")
                await ws.send_text(observation(f"Guess a number from 1 to 10. {cue}"))
            elif kind == "step":
                guess = data.get("message")
                if guess is None:
                    await ws.send_text(json.dumps({"type": "error", "data": {
                        "message": "action has no field `message`", "code": "VALIDATION_ERROR"}}))
                elif "boom" in cue:
                    await ws.send_text(json.dumps({"type": "error", "data": {
                        "message": "the game crashed", "code": "EXECUTION_ERROR"}}))
                elif "hang" in cue:
                    await asyncio.sleep(3600)
                elif "junk" in cue:
                    await ws.send_text("<html>oops</html>")
                elif "drop" in cue:
                    await ws.close()
                    return
                elif "odd" in cue:
                    await ws.send_text(json.dumps({"type": "observation", "data": {
                        "observation": {"prompt": "?"}, "reward": "high", "done": "maybe"}}))
                elif str(secret) in guess:
                    await ws.send_text(observation("Right!", 1.0, True))
                else:
                    await ws.send_text(observation("Wrong, try again.", 0.0, False))
            else:
                await ws.send_text(json.dumps({"type": "error", "data": {
                    "message": f"Unknown message type: {kind}", "code": "UNKNOWN_TYPE"}}))
    except WebSocketDisconnect:
        pass
    finally:
        SESSIONS["closed"] += 1


def serve() -> tuple[str, uvicorn.Server]:
    """The app on a free local port, on a thread: its base URL, and the server (`should_exit` stops it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the OpenEnv test server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server
