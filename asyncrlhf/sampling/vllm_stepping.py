"""vLLM's engine driven one step at a time: the `StepEngine` of continuous generation, shared with the API.

Why the engine's own `step()` and not its async engine: on CPU the engine core runs in the generator's
process (`vllm_engine.engine_settings`), so `LLMEngine.step()` is exactly the loop `LLM.generate` runs, with
no extra process, socket or event loop per token; and a loop that owns the steps owns the moments between
them, which is where a verified push is applied (the gate keeps swaps out while a step runs). vLLM's
scheduler does the continuous batching: sequences join and leave the running batch at any step.

Every sequence of the loop is one request with `n=1` and `RequestOutputKind.DELTA`: each step returns the
tokens it sampled, which the sampler records with the version that sampled them. Requests of other clients
(the `/v1` API through `VLLMBackend.generate` and `score_tokens`) are queued by their own threads and added
at the next step; their final outputs resolve their futures. So the API and the training loop share one
engine, and its batch.

After a push (`VLLMBackend.apply_weights`) the sequences in flight keep their KV cache
(`generator.vllm.inflight_kv: keep`, the default, as PipelineRL does: the prefix attended to was computed by
the weights that sampled it) or are re-computed under the new weights (`recompute`: vLLM preempts every
running sequence and prefills it again; docs/pipeline.md measures both).
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.backend import Finish
from asyncrlhf.sampling.continuous import StepDelta

API_TIMEOUT_S = 600.0  # an API request the loop never steps (the generator is stopping) fails after this


@dataclass
class _Submitted:
    request_id: str
    prompt_ids: list[int]
    params: Any
    future: Future


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
    """A `StepEngine` over `backend.llm`'s engine. Only the thread that calls `step` touches the engine;
    other threads `submit` requests and wait for their final outputs."""

    def __init__(self, backend: Any, seed: int = 0):
        self.backend = backend
        # the loop's own seeds: the API's seeded requests draw theirs from torch's global RNG, forked per call
        self._rng = torch.Generator().manual_seed(seed)
        self.engine = backend.llm.llm_engine
        self._submitted: queue.Queue[_Submitted] = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count()

    # -- the loop's sequences ----------------------------------------------------------------------------

    def add(self, key: str, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingConfig) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k or -1, max_tokens=max_tokens, logprobs=0,
                                seed=int(torch.randint(0, 2**62, (), generator=self._rng).item()),
                                output_kind=RequestOutputKind.DELTA)
        self.engine.add_request(key, {"prompt_token_ids": list(prompt_ids)}, params,
                                lora_request=self.backend.lora_request)

    def step(self) -> list[StepDelta]:
        self._admit_submitted()
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
        if keys:
            self.engine.abort_request(list(keys))

    def running(self) -> int:
        return self.engine.get_num_unfinished_requests()

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
        """Fail every request not answered (the loop stops stepping)."""
        while not self._submitted.empty():
            self._submitted.get_nowait().future.set_exception(RuntimeError(reason))
        for future in self._futures.values():
            future.set_exception(RuntimeError(reason))
        self._futures.clear()

    def _admit_submitted(self) -> None:
        while not self._submitted.empty():
            item = self._submitted.get_nowait()
            try:
                self.engine.add_request(item.request_id, {"prompt_token_ids": item.prompt_ids}, item.params,
                                        lora_request=self.backend.lora_request)
            except Exception as err:  # a request the engine refuses fails alone
                item.future.set_exception(err)
                continue
            self._futures[item.request_id] = item.future
