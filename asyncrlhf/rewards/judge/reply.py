"""What a judge answers, and how its answer becomes a value (`JudgeConfig.reply`):

- `logprob`: the probability of the first of `choices` among all of them at the reply's first token,
  p(c0) / sum_i p(ci), each p(ci) summed over the alternatives whose text is ci (any case, spaces
  stripped: " Yes", "yes" and "YES" are one choice). A value in [0, 1] that moves smoothly with the
  judge's belief, and a reply always has one unless none of the choices is among the alternatives given.
- `number`: the first number in the reply, or the first group of `pattern`, or the field `json_field` of the
  first JSON object in it.
- `label`: the first word of the reply (or `pattern`'s group, or `json_field`), mapped by `labels`.

A reply that cannot be read raises `Unparsed`; the judge then scores `parse_fail_reward` and counts it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from asyncrlhf.config import JudgeConfig
from asyncrlhf.rewards.base import ScorerConfigError

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
WORD = re.compile(r"[A-Za-z]+")


class Unparsed(ValueError):
    """The judge answered, but its reply holds no value the config can read."""


@dataclass(frozen=True)
class Reply:
    """One judge reply: its text, and for `reply: logprob` the alternatives at its first token (token text
    -> log p, the model's own distribution)."""

    text: str
    top: Mapping[str, float] = field(default_factory=dict)


class ReplyReader:
    """Turns a `Reply` into a float as `JudgeConfig.reply` says."""

    def __init__(self, cfg: JudgeConfig):
        self.mode, self.json_field = cfg.reply, cfg.json_field
        self.choices = [c.strip().casefold() for c in cfg.choices_or_default]
        self.labels = cfg.labels_or_default
        try:
            self.pattern = re.compile(cfg.pattern) if cfg.pattern is not None else None
        except re.error as err:
            raise ScorerConfigError(f"the judge's pattern {cfg.pattern!r} is not a regex: {err}") from None
        if self.pattern is not None and self.pattern.groups < 1 and cfg.reply != "logprob":
            raise ScorerConfigError(f"the judge's pattern {cfg.pattern!r} needs a group around the value, "
                                    "e.g. 'Score: (\\d+)'")

    def value(self, reply: Reply) -> float:
        if self.mode == "logprob":
            return choice_share(reply.top, self.choices)
        raw = self._raw(reply.text)
        if self.mode == "number":
            found = NUMBER.search(str(raw))
            if found is None:
                raise Unparsed(f"no number in {str(raw)[:80]!r}")
            value = float(found.group())
            if not math.isfinite(value):
                raise Unparsed(f"{value} is not a finite number")
            return value
        word = WORD.search(str(raw))
        label = (word.group() if word and self.pattern is None and self.json_field is None else str(raw))
        if label.strip().casefold() not in self.labels:
            raise Unparsed(f"{label.strip()[:40]!r} is none of the labels {sorted(self.labels)}")
        return self.labels[label.strip().casefold()]

    def _raw(self, text: str) -> object:
        """The part of the reply that holds the value: `json_field` of its first JSON object, `pattern`'s
        first group, or the whole text."""
        if self.json_field is not None:
            obj = first_json_object(text)
            if self.json_field not in obj:
                raise Unparsed(f"no field {self.json_field!r} in the reply's JSON {str(obj)[:80]}")
            return obj[self.json_field]
        if self.pattern is not None:
            found = self.pattern.search(text)
            if found is None:
                raise Unparsed(f"the pattern {self.pattern.pattern!r} does not match {text[:80]!r}")
            return found.group(1)
        return text


def choice_share(top: Mapping[str, float], choices: list[str]) -> float:
    """p(choices[0]) / sum_i p(choices[i]) over the alternatives `top` (token text -> log p)."""
    mass = [0.0] * len(choices)
    for token, logprob in top.items():
        key = token.strip().casefold()
        if key in choices:
            mass[choices.index(key)] += math.exp(logprob)
    total = sum(mass)
    if total <= 0:
        raise Unparsed(f"none of {choices} is among the reply's first-token alternatives "
                       f"{sorted(top, key=lambda t: -top[t])[:5]}")
    return mass[0] / total


def first_json_object(text: str) -> dict:
    """The first `{...}` in `text` that parses as a JSON object."""
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise Unparsed(f"no JSON object in {text[:80]!r}")
