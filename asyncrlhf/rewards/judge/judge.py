"""The judge: template, engine, reply reader and cache, turning requests (the template's variables) into
values; what the judge scorer (`scorer.py`) and the evaluator's judged win rate both ask.

    judge = Judge.from_config(cfg)                     # the engine loads here (or the endpoint is named)
    judge.values([{"prompt": p, "completion": c, "reference": ""}, ...])   # float, or None: no parse

Each request is rendered and looked up in the cache; the misses, one per distinct rendered prompt, go to the
engine in one call (batched by a local engine, `max_in_flight` at a time to an endpoint). A reply that does
not parse is None (the caller scores `parse_fail_reward`) and is counted. A call that got no reply raises
`ScorerError` after every other reply of the batch is cached, so retrying the batch (the reward loop does)
asks only for what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from asyncrlhf.config import JudgeConfig
from asyncrlhf.rewards.base import ScorerError
from asyncrlhf.rewards.judge.cache import VerdictCache, request_key
from asyncrlhf.rewards.judge.engine import JudgeCallError, JudgeEngine, LocalEngine
from asyncrlhf.rewards.judge.meter import JudgeMeter, NullMeter
from asyncrlhf.rewards.judge.reply import Reply, ReplyReader, Unparsed
from asyncrlhf.rewards.judge.template import JudgeTemplate

log = logging.getLogger(__name__)


class Judge:
    def __init__(self, cfg: JudgeConfig, engine: JudgeEngine, meter: JudgeMeter | None = None):
        self.cfg, self.engine, self.meter = cfg, engine, meter or NullMeter()
        self.template = JudgeTemplate.from_config(cfg)
        self.reader = ReplyReader(cfg)
        self.cache = VerdictCache(cfg.cache_size)
        self.parse_failures = 0  # replies that held no value, since the judge was built
        self.mode = f"{cfg.reply}|{cfg.choices_or_default}|{cfg.pattern}|{cfg.json_field}|{cfg.labels}"

    @classmethod
    def from_config(cls, cfg: JudgeConfig, seed: int = 0, meter: JudgeMeter | None = None) -> Judge:
        from asyncrlhf.rewards.judge.endpoint import EndpointEngine

        meter = meter or NullMeter()
        engine: JudgeEngine = (EndpointEngine(cfg, meter=meter) if cfg.remote
                               else LocalEngine.from_config(cfg, seed, meter=meter))
        log.info("judge %s (%s, reply %s)", engine.identity, cfg.compare, cfg.reply)
        return cls(cfg, engine, meter)

    @property
    def truncated(self) -> int:
        """Judge prompts cut to the model's max_prompt_tokens (an engine in this process)."""
        return getattr(self.engine, "truncated", 0)

    def values(self, requests: Sequence[Mapping[str, str]]) -> list[float | None]:
        """Each request's value (None where the reply did not parse)."""
        rendered = [self.template.render(**r) for r in requests]
        keys = [request_key(self.engine.identity, self.mode, text) for text in rendered]
        out: list[float | None] = [None] * len(requests)
        missing: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            found, value = self.cache.get(key)
            if found:
                out[i] = value
            else:
                missing.setdefault(key, []).append(i)
        self.meter.cache_hits(len(requests) - sum(len(v) for v in missing.values()))
        if not missing:
            return out
        replies = self.engine.ask([rendered[idx[0]] for idx in missing.values()], self.cfg.reply == "logprob")
        failed = [r for r in replies if isinstance(r, JudgeCallError)]
        for (key, indices), reply in zip(missing.items(), replies, strict=True):
            if isinstance(reply, Reply):
                value = self._read(reply)
                self.cache.put(key, value)
                for i in indices:
                    out[i] = value
        if failed:
            raise ScorerError(f"judge: {len(failed)} of {len(missing)} calls got no reply (the other replies "
                              f"are cached); first: {failed[0]}")
        return out

    def _read(self, reply: Reply) -> float | None:
        try:
            return self.reader.value(reply)
        except Unparsed as why:
            self.parse_failures += 1
            self.meter.parse_failed(1)
            log.debug("judge reply did not parse (%s): %r", why, reply.text[:200])
            return None

    def close(self) -> None:
        self.engine.close()

