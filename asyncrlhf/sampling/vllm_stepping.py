"""vLLM's engine driven one step at a time: the `StepEngine` of continuous generation, shared with the API.

Why the engine's own `step()` and not its async engine: on CPU the engine core runs in the generator's
process (`vllm_engine.engine_settings`), so `LLMEngine.step()` is exactly the loop `LLM.generate` runs, with
no extra process, socket or event loop per token; and a loop that owns the steps owns the moments between
them, which is where a verified push is applied. vLLM's scheduler does the continuous batching: sequences
join and leave the running batch at any step.

One thread talks to the engine: the one that built the `VLLMStepEngine` (the generator's loop). vLLM's
client of an engine in a process of its own (`SyncMPClient`) sends every add, abort, step and utility call
(pause, load, reset, label) on one ZMQ socket without a lock, and ZMQ sockets are not thread-safe: two
threads sending at once garble a message and kill the engine. So other threads never call it; they queue:
the loop's own adds and other clients' requests (the `/v1` API through `VLLMBackend.generate` and
`score_tokens`) are added at the next `step`, and a weight push's engine work (`call`, from the gRPC thread)
runs when the loop calls `serve_calls` between two steps, while the push's thread waits for it. `step`,
`abort` and `serve_calls` refuse any other thread, so the invariant holds by construction, not by care.

Every sequence of the loop is one request with `n=1` and `RequestOutputKind.DELTA`: each step returns the
tokens it sampled, which the sampler records with the version that sampled them. Other clients' final
outputs resolve their futures. So the API and the training loop share one engine, and its batch. Every
request carries the backend's cache salt of the moment it is added (`VLLMBackend.cache_salt`: the policy
version), so it never reuses KV blocks another version's weights computed.

After a push (`VLLMBackend.apply_weights`) the sequences in flight keep their KV cache
(`generator.vllm.inflight_kv: keep`, the default, as PipelineRL does: the prefix attended to was computed by
the weights that sampled it) or are re-computed under the new weights (`recompute`: vLLM preempts every
running sequence and prefills it again; docs/pipeline.md measures both).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.backend import Finish
from asyncrlhf.sampling.continuous import StepDelta

T = TypeVar("T")
API_TIMEOUT_S = 600.0  # an API request the loop never steps (the generator is stopping) fails after this


class EngineStopped(RuntimeError):
    """The engine's thread no longer runs queued work (the generator is stopping)."""


@dataclass
class _Submitted:
    request_id: str
    prompt_ids: list[int]
    params: Any
    future: Future


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future


def salted(prompt_ids: Sequence[int], salt: str) -> dict[str, Any]:
    """A token-id prompt that shares KV blocks only with prompts of the same `salt` (vLLM's `cache_salt`
    enters the hash of a prompt's first block, and so of every block after it)."""
    return {"prompt_token_ids": list(prompt_ids), "cache_salt": salt}


def finish_of(reason: str | None) -> Finish:
    return "stop" if reason == "stop" else "length"


def engine_versions(spans: Sequence[Any] | None) -> tuple[int | None, ...] | None:
    """The version of each of a finished request's tokens from vLLM's weight-version spans (tokens
    `[start, end)` sampled under label `version`: `VLLMBackend` labels each version it loads with its step);
    None for a token sampled under a label that is not a step (vLLM's "default", before the first push), and
    None for all when the engine reported no span."""
    if not spans:
        return None
    versions: list[int | None] = []
    for span in spans:
        label = int(span.version) if span.version.isdigit() else None
        versions += [label] * (span.end - span.start)
    return tuple(versions)


class VLLMStepEngine:
    """A `StepEngine` over `backend.llm`'s engine. Only the thread that built it touches the engine (module
    docstring); other threads `submit` requests and `call` work, and wait for the results."""

    def __init__(self, backend: Any, seed: int = 0):
        self.backend = backend
        # the loop's own seeds: the API's seeded requests draw theirs from torch's global RNG, forked per call
        self._rng = torch.Generator().manual_seed(seed)
        self.engine = backend.llm.llm_engine
        self._owner = threading.get_ident()
        self._adds: dict[str, tuple[list[int], Any]] = {}  # the loop's sequences, added at the next step
        self._submitted: queue.Queue[_Submitted] = queue.Queue()
        self._calls: queue.Queue[_Call] = queue.Queue()
        self._closed = False
        self._closing = threading.Lock()  # a call is queued before the close, or refused: never stranded
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count()

    # -- the loop's sequences ----------------------------------------------------------------------------

    def add(self, key: str, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingConfig) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_thread("add")
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k or -1, max_tokens=max_tokens, logprobs=0,
                                seed=int(torch.randint(0, 2**62, (), generator=self._rng).item()),
                                output_kind=RequestOutputKind.DELTA)
        self._adds[key] = (list(prompt_ids), params)

    def step(self) -> list[StepDelta]:
        self._check_thread("step")
        self._admit()
        if not self.engine.has_unfinished_requests():
            return []
        deltas: list[StepDelta] = []
        for out in self.engine.step():  # another client's request has a future; the rest are the loop's
            if out.request_id not in self._futures:
                deltas.append(self._delta(out))
            elif out.finished:
                self._futures.pop(out.request_id).set_result(out)
        return deltas

    def abort(self, keys: Sequence[str]) -> None:
        self._check_thread("abort")
        added = [key for key in keys if self._adds.pop(key, None) is None]
        if added:
            self.engine.abort_request(added)

    def running(self) -> int:
        return self.engine.get_num_unfinished_requests() + len(self._adds)

    def pending(self) -> bool:
        """Whether another client's request waits to be added."""
        return not self._submitted.empty()

    @staticmethod
    def _delta(out: Any) -> StepDelta:
        c = out.outputs[0]
        ids = list(c.token_ids)
        logps = [step[token].logprob for step, token in zip(c.logprobs or [], ids, strict=True)]
        if not out.finished:
            return StepDelta(out.request_id, ids, logps)
        return StepDelta(out.request_id, ids, logps, finish_of(c.finish_reason),
                         engine_versions(getattr(c, "weight_versions", None)))

    # -- work for the engine from other threads ------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` (work that talks to the engine: a weight push's) run by the engine's thread: at once when
        called there, else queued for its next `serve_calls` and waited for. Raises `EngineStopped` once the
        loop stopped serving calls."""
        if threading.get_ident() == self._owner:
            return fn()
        call = _Call(fn, Future())
        with self._closing:
            if self._closed:
                raise EngineStopped("the generator is stopping: its engine takes no more work")
            self._calls.put(call)
        return call.future.result()

    def serve_calls(self, timeout_s: float = 0.0) -> int:
        """Run the work other threads queued (`call`), waiting up to `timeout_s` for some when none is
        queued; returns how many ran."""
        self._check_thread("serve_calls")
        try:
            calls = [self._calls.get(timeout=timeout_s) if timeout_s > 0 else self._calls.get_nowait()]
        except queue.Empty:
            return 0
        while not self._calls.empty():
            calls.append(self._calls.get_nowait())
        for call in calls:
            try:
                call.future.set_result(call.fn())
            except BaseException as err:  # the caller's to handle (a refused push): raised in its thread
                call.future.set_exception(err)
        return len(calls)

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(f"VLLMStepEngine.{what} from thread {threading.current_thread().name}: only "
                               "the thread that built it talks to the engine (others queue: `call`, `run`)")

    # -- other clients' requests -------------------------------------------------------------------------

    def run(self, prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
        """The final RequestOutput of each prompt, sampled with `params` in the loop's steps (blocks)."""
        futures = []
        for prompt in prompts:
            future: Future = Future()
            self._submitted.put(_Submitted(f"api-{next(self._ids)}", list(prompt), params, future))
            futures.append(future)
        return [f.result(timeout=API_TIMEOUT_S) for f in futures]

    def fail_waiting(self, reason: str) -> None:
        """Fail every request and call not answered, and refuse calls from now on (the loop stops)."""
        with self._closing:
            self._closed = True
        while not self._calls.empty():
            self._calls.get_nowait().future.set_exception(EngineStopped(reason))
        while not self._submitted.empty():
            self._submitted.get_nowait().future.set_exception(RuntimeError(reason))
        for future in self._futures.values():
            future.set_exception(RuntimeError(reason))
        self._futures.clear()

    def _admit(self) -> None:
        """Add the loop's queued sequences and other clients' requests, each salted with the version now
        served (`VLLMBackend.cache_salt`)."""
        salt = self.backend.cache_salt
        lora = self.backend.lora_request
        adds, self._adds = self._adds, {}
        for key, (ids, params) in adds.items():
            self.engine.add_request(key, salted(ids, salt), params, lora_request=lora)
        while not self._submitted.empty():
            item = self._submitted.get_nowait()
            try:
                self.engine.add_request(item.request_id, salted(item.prompt_ids, salt), item.params,
                                        lora_request=lora)
            except Exception as err:  # a request the engine refuses fails alone
                item.future.set_exception(err)
                continue
            self._futures[item.request_id] = item.future
