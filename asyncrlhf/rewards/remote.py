"""A client for a remote reward server speaking OpenRLHF's protocol (`openrlhf.cli.serve_rm` and friends).

    POST <url>/get_reward  {"query": [prompt + completion, ...], "prompts": [...], "labels": [...]}
                        -> {"rewards": [...], "scores": [...]?, "extra_logs": {name: [...]}?}

`query` is the prompt and completion concatenated, as OpenRLHF sends it; `prompts` and `labels` are what its
recent clients add (labels are "" where there is none). `extra_logs` lists of the right length become named
components. Connection errors, timeouts, 429 and 5xx are retried with exponential back-off; other 4xx
answers and malformed bodies fail at once, since repeating the request cannot fix them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from asyncrlhf.rewards.base import ScorerConfigError, ScorerError, ScoreResult

RETRY_STATUS = {429, 500, 502, 503, 504}


class RemoteScorer:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ScorerConfigError(f"remote scorer url must start with http:// or https://, got `{url}`")
        self.url = url if url.rstrip("/").endswith("/get_reward") else url.rstrip("/") + "/get_reward"
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers, transport=transport)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str] | None = None
    ) -> ScoreResult:
        payload = {
            "query": [p + c for p, c in zip(prompts, completions, strict=True)],
            "prompts": list(prompts),
            "labels": list(labels) if labels is not None else [""] * len(prompts),
        }
        body = self._post(payload)
        return _parse(body, len(prompts), self.url)

    def _post(self, payload: dict) -> dict:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.client.post(self.url, json=payload)
            except httpx.TransportError as err:  # connect error, timeout, reset
                last = f"{type(err).__name__}: {err}"
                continue
            if response.status_code in RETRY_STATUS:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:
                raise ScorerError(
                    f"remote scorer {self.url} answered HTTP {response.status_code}: {response.text[:500]}"
                )
            try:
                return response.json()
            except ValueError:
                raise ScorerError(
                    f"remote scorer {self.url} answered non-JSON: {response.text[:200]!r}"
                ) from None
        raise ScorerError(f"remote scorer {self.url} failed {self.retries + 1} times; last error: {last}")

    def close(self) -> None:
        self.client.close()


def _parse(body: object, n: int, url: str) -> ScoreResult:
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
        raise ScorerError(f"remote scorer {url} answered without a `rewards` list: {str(body)[:200]}")
    try:
        scores = [float(v) for v in body["rewards"]]
    except (TypeError, ValueError):
        raise ScorerError(
            f"remote scorer {url}: `rewards` must be numbers, got {body['rewards'][:5]}"
        ) from None
    extra = body.get("extra_logs") or {}
    components = {}
    if isinstance(extra, dict):
        for name, values in extra.items():
            if (
                isinstance(values, list)
                and len(values) == n
                and all(isinstance(v, (int, float)) for v in values)
            ):
                components[str(name)] = [float(v) for v in values]
    return ScoreResult(scores, components).check(n, f"remote scorer {url}")
