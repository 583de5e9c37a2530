"""Rule rewards: Python functions picked by name from `RULES`, or loaded from a user file (`my.py:fn`).

A rule is `fn(prompts, completions, **args) -> scores` where `args` are the scorer's config `args`. It may
return a list (or tensor, or array) of B floats, a `ScoreResult`, or OpenRLHF's dict shape
`{"rewards": [...], "extra_logs": {name: [...]}}` (the extra logs become named components). A rule that
declares a `labels` parameter (or `**kwargs`) also receives per-item reference answers when the request
carries them (OpenRLHF's `labels`); the consumer loop has none, so verifiable rules there read their
reference from `args` (see `exact_match`).

Shipped: `sentiment` (the demo task's gold reward), `length_penalty`, `length_band` (the `varlen` task's
requested lengths), `regex_match`, `exact_match`, `math_answer` (GSM8k/MATH final answers, `rewards/math.py`).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrlhf.rewards.base import ScorerConfigError, ScorerError, ScoreResult
from asyncrlhf.rewards.math import math_score
from asyncrlhf.tasks.varlen import band_of

RuleFn = Callable[..., Any]
RULES: dict[str, RuleFn] = {}


def rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule under `name` (a decorator)."""

    def register(fn: RuleFn) -> RuleFn:
        RULES[name] = fn
        return fn

    return register


@functools.lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


@rule("sentiment")
def sentiment(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """The demo task's gold reward: VADER compound sentiment of the completion, in [-1, 1]."""
    analyzer = _vader()
    return [analyzer.polarity_scores(text)["compound"] for text in completions]


@rule("length_penalty")
def length_penalty(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    target: int = 0,
    coef: float = 0.01,
    unit: str = "words",
    **_: Any,
) -> list[float]:
    """`-coef * max(0, length - target)`, length in `unit` ("words" or "chars"): 0 up to the target."""
    if unit not in ("words", "chars"):
        raise ScorerConfigError(f"length_penalty: unit must be `words` or `chars`, got `{unit}`")
    lengths = [len(c.split()) if unit == "words" else len(c) for c in completions]
    return [-coef * max(0, n - target) for n in lengths]


@rule("length_band")
def length_band(prompts: Sequence[str], completions: Sequence[str], *, strict: bool = False,
                **_: Any) -> list[float]:
    """How well the completion's length in words meets the band its prompt asks for (`tasks/varlen.py`:
    "in one sentence" 5-30 words ... "in detail" 90-150): 1.0 inside [min, max]. Outside, 0.0 with `strict`
    (the `varlen` gold), else a ramp a policy can climb: n / min below, max(0, 1 - (n - max) / max) above."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        band = band_of(prompt)
        if band is None:
            raise ValueError(f"the prompt {prompt[:60]!r} asks for no length band; `length_band` scores the "
                             "`varlen` task's prompts (task.name: varlen)")
        n, low, high = len(completion.split()), band.min_words, band.max_words
        if low <= n <= high:
            out.append(1.0)
        elif strict:
            out.append(0.0)
        else:
            out.append(n / low if n < low else max(0.0, 1.0 - (n - high) / high))
    return out


@rule("regex_match")
def regex_match(
    prompts: Sequence[str], completions: Sequence[str], *, pattern: str, fullmatch: bool = False, **_: Any
) -> list[float]:
    """1.0 where the completion matches `pattern` (re.search; whole text with `fullmatch`), else 0.0."""
    compiled = _compile(pattern)
    match = compiled.fullmatch if fullmatch else compiled.search
    return [1.0 if match(c.strip() if fullmatch else c) else 0.0 for c in completions]


@rule("exact_match")
def exact_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    labels: Sequence[str] | None = None,
    *,
    answer: str | None = None,
    answers: Mapping[str, str] | None = None,
    extract: str | None = None,
    case_sensitive: bool = False,
    **_: Any,
) -> list[float]:
    """1.0 where the completion's answer equals the reference, else 0.0 (also 0.0 with no reference).

    Reference, first found: the item's label (OpenRLHF `labels`, HTTP requests), `answers[prompt]`, `answer`.
    The completion's answer is the first group of `extract` (e.g. `"\\\\boxed\\{(.*?)\\}"`) when given, else
    the whole completion; both sides are whitespace-stripped, and lower-cased unless `case_sensitive`.
    """
    extractor = _compile(extract) if extract else None
    norm = (lambda s: s.strip()) if case_sensitive else (lambda s: s.strip().lower())
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        reference = (labels[i] if labels else None) or (answers or {}).get(prompt) or answer
        answer_text: str | None = completion
        if extractor is not None:
            found = extractor.search(completion)
            answer_text = (found.group(1) if found.groups() else found.group(0)) if found else None
        out.append(
            1.0
            if reference is not None and answer_text is not None and norm(answer_text) == norm(reference)
            else 0.0
        )
    return out


@rule("math_answer")
def math_answer(
    prompts: Sequence[str],
    completions: Sequence[str],
    labels: Sequence[str] | None = None,
    *,
    answers: Mapping[str, str] | None = None,
    **_: Any,
) -> list[float]:
    """1.0 where the completion's final answer (boxed, `####`, "answer is", else the last number) equals the
    reference's as a number or normalised text, else 0.0. Reference: the item's label (the task's
    `reference_field`, carried with the prompt), else `answers[prompt]`."""
    refs = [(labels[i] if labels else None) or (answers or {}).get(p) or "" for i, p in enumerate(prompts)]
    return [math_score(c, r) for c, r in zip(completions, refs, strict=True)]


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ScorerConfigError(f"invalid regular expression {pattern!r}: {err}") from None


# ---------------------------------------------------------------------------------------------------------
# Resolving a rule and running it


def resolve_rule(name: str) -> RuleFn:
    """A registry name, or `path/to/file.py:function` (path relative to the working directory)."""
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return load_rule_file(*name.rsplit(":", 1))
    if name in RULES:
        return RULES[name]
    guess = difflib.get_close_matches(name, list(RULES), n=1)
    hint = f"did you mean `{guess[0]}`? " if guess else ""
    raise ScorerConfigError(
        f"unknown rule `{name}`; {hint}shipped rules: {', '.join(sorted(RULES))}, "
        "or give `path/to/file.py:function`"
    )


def load_rule_file(path: str, function: str) -> RuleFn:
    """Import `function` from the Python file at `path` (a module of its own, keyed by the file's path)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ScorerConfigError(f"reward file {file} does not exist (from `{path}:{function}`)")
    module_name = f"asyncrlhf_user_rewards_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ScorerConfigError(f"reward file {file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so dataclasses and pickling inside the file work
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ScorerConfigError(f"importing reward file {file} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, function, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ScorerConfigError(
            f"{file} has no function `{function}`; it defines: {', '.join(names) or 'none'}"
        )
    return fn


class RuleScorer:
    """Runs one rule with fixed `args`; checks and normalises what it returns."""

    def __init__(self, name: str, args: Mapping[str, Any] | None = None):
        self.name = name
        self.fn = resolve_rule(name)
        self.args = dict(args or {})
        signature = inspect.signature(self.fn)
        try:
            signature.bind([], [], **self.args)
        except TypeError as err:
            raise ScorerConfigError(
                f"rule `{name}` does not accept args {self.args}: {err}; its signature: {signature}"
            ) from None
        params = signature.parameters.values()
        self._takes_labels = any(p.name == "labels" or p.kind is p.VAR_KEYWORD for p in params)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str] | None = None
    ) -> ScoreResult:
        kwargs = dict(self.args)
        if labels is not None and self._takes_labels:
            kwargs["labels"] = list(labels)
        try:
            out = self.fn(list(prompts), list(completions), **kwargs)
        except Exception as err:
            raise ScorerError(f"rule `{self.name}` raised {type(err).__name__}: {err}") from err
        return _as_result(out, self.name).check(len(completions), f"rule `{self.name}`")


def _as_result(out: Any, who: str) -> ScoreResult:
    if isinstance(out, ScoreResult):
        return out
    if isinstance(out, Mapping):
        if "rewards" not in out:
            raise ScorerError(f"rule `{who}` returned a dict without `rewards` (keys: {list(out)})")
        extra = out.get("extra_logs") or {}
        return ScoreResult(_floats(out["rewards"], who), {k: _floats(v, who) for k, v in extra.items()})
    return ScoreResult(_floats(out, who))


def _floats(values: Any, who: str) -> list[float]:
    if hasattr(values, "tolist"):  # tensor or array
        values = values.tolist()
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ScorerError(
            f"rule `{who}` must return a list of numbers, got {type(values).__name__}: {err}"
        ) from None
