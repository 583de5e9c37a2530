"""The judge as any OpenAI-compatible server: `vllm serve`, an asyncrlhf generator's `/v1`, a hosted API.

Each rendered prompt is one request, at temperature 0, at most `judge.max_in_flight` in flight at once:
`/v1/chat/completions` with the prompt as the user message (`judge.system` first), or `/v1/completions`
with the prompt as it is (`judge.endpoint.api`). `reply: logprob` asks for one token and its
`top_logprobs`; otherwise up to `judge.max_new_tokens` tokens of text.

Every request has its own timeout (`judge.timeout_s`) and retries (`judge.retries`, exponential back-off)
on a timeout, a lost connection, 429 and 5xx. A request that still has no answer becomes a
`JudgeCallError` for that prompt alone: the other requests of the batch keep their replies. Other 4xx
answers are not retried (repeating the request cannot fix them) and end that call too. The API key, when
the server wants one, is read from the environment variable `judge.endpoint.api_key_env` names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from asyncrlhf.config import JudgeConfig
from asyncrlhf.rewards.base import ScorerConfigError
from asyncrlhf.rewards.judge.engine import JudgeCallError
from asyncrlhf.rewards.judge.meter import JudgeMeter, NullMeter, Outcome
from asyncrlhf.rewards.judge.reply import Reply

RETRY_STATUS = {429, 500, 502, 503, 504}


class EndpointEngine:
    """Requests to one OpenAI-compatible server, `max_in_flight` at a time."""

    def __init__(self, cfg: JudgeConfig, *, backoff_s: float = 0.2, meter: JudgeMeter | None = None):
        url = cfg.endpoint.url or ""
        if not url.startswith(("http://", "https://")):
            raise ScorerConfigError(f"the judge's endpoint.url must start with http:// or https://, got "
                                    f"`{url}`")
        self.cfg, self.backoff_s, self.meter = cfg, backoff_s, meter or NullMeter()
        self.identity = f"endpoint:{url.rstrip('/')}:{cfg.endpoint.model}:{cfg.endpoint.api}"
        self.client = httpx.Client(base_url=url.rstrip("/") + "/", timeout=cfg.timeout_s,
                                   headers=_auth(cfg.endpoint.api_key_env),
                                   limits=httpx.Limits(max_connections=cfg.max_in_flight))
        self.pool = ThreadPoolExecutor(cfg.max_in_flight, thread_name_prefix="judge")

    def ask(self, prompts: Sequence[str], logprob: bool) -> list[Reply | JudgeCallError]:
        return list(self.pool.map(lambda p: self._call(p, logprob), prompts))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _call(self, prompt: str, logprob: bool) -> Reply | JudgeCallError:
        """One prompt's request with its retries: the reply, or why there is none."""
        path, body = self._request(prompt, logprob)
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            started = time.perf_counter()
            self.meter.started(1)
            outcome: Outcome = "failed"
            try:
                response = self.client.post(path, json=body)
                if response.status_code == 200:
                    outcome = "answered"
                    return self._reply(response, logprob)
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code not in RETRY_STATUS:
                    return JudgeCallError(f"judge endpoint {self.client.base_url}{path} answered {last}")
            except httpx.TimeoutException as err:
                outcome, last = "timeout", f"timed out after {self.cfg.timeout_s:g} s ({type(err).__name__})"
            except httpx.TransportError as err:  # connection refused or reset: a server gone or restarting
                last = f"{type(err).__name__}: {err}"
            finally:
                self.meter.ended(1, time.perf_counter() - started, outcome)
        return JudgeCallError(f"judge endpoint {self.client.base_url}{path}: no answer after "
                              f"{self.cfg.retries + 1} tries; last: {last}")

    def _request(self, prompt: str, logprob: bool) -> tuple[str, dict[str, Any]]:
        e = self.cfg.endpoint
        body: dict[str, Any] = {"model": e.model, "temperature": 0.0,
                                "max_tokens": 1 if logprob else self.cfg.max_new_tokens}
        if e.api == "completions":
            top = {"logprobs": e.top_logprobs} if logprob else {}
            return "completions", {**body, "prompt": prompt, **top}
        messages = ([{"role": "system", "content": self.cfg.system}] if self.cfg.system else [])
        messages.append({"role": "user", "content": prompt})
        extra = {"logprobs": True, "top_logprobs": e.top_logprobs} if logprob else {}
        return "chat/completions", {**body, "messages": messages, **extra}

    def _reply(self, response: httpx.Response, logprob: bool) -> Reply | JudgeCallError:
        """The reply in an OpenAI body; a body that is not one ends the call (the server is not one)."""
        try:
            choice = response.json()["choices"][0]
            if self.cfg.endpoint.api == "completions":
                text = choice.get("text") or ""
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or [{}]
                top = dict(tops[0] or {}) if logprob else {}
            else:
                text = (choice.get("message") or {}).get("content") or ""
                content = (choice.get("logprobs") or {}).get("content") or [{}]
                alternatives = content[0].get("top_logprobs", []) if logprob else []
                top = {t["token"]: t["logprob"] for t in alternatives}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            return JudgeCallError(f"judge endpoint {response.url} answered a body that is not an OpenAI "
                                  f"completion ({type(err).__name__}: {err}): {response.text[:200]}")
        return Reply(text, {str(k): float(v) for k, v in top.items()})


def _auth(env_name: str | None) -> dict[str, str]:
    if env_name is None:
        return {}
    key = os.environ.get(env_name)
    if not key:
        raise ScorerConfigError(f"the judge's endpoint.api_key_env names ${env_name}, which is not set: "
                                "export it with the server's API key")
    return {"Authorization": f"Bearer {key}"}
