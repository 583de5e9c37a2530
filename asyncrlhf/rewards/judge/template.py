"""The judge's prompt: a template, inline or from a file, in Jinja (sandboxed: a template cannot reach
Python objects) or Python's `str.format`, rendered with the prompt, the answer(s) and the reference.

    single:   prompt, completion, reference
    pairwise: prompt, completion_a, completion_b, reference

`reference` is the task's reference answer ("" where there is none). A template that names anything else
fails when the judge is built, not at its first reply.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

from asyncrlhf.config import JudgeConfig
from asyncrlhf.rewards.base import ScorerConfigError

Compare = Literal["single", "pairwise"]
FIELDS: dict[str, tuple[str, ...]] = {
    "single": ("prompt", "completion", "reference"),
    "pairwise": ("prompt", "completion_a", "completion_b", "reference"),
}

SINGLE = """You are grading an answer to a request.

Request: {{ prompt }}
{% if reference %}Reference answer: {{ reference }}
{% endif %}Answer: {{ completion }}

Is the answer a good reply to the request? Reply with Yes or No only."""

PAIRWISE = """You are comparing two answers to the same request.

Request: {{ prompt }}
{% if reference %}Reference answer: {{ reference }}
{% endif %}Answer A: {{ completion_a }}
Answer B: {{ completion_b }}

Which answer is better? Reply with A or B only."""

SHIPPED = {"single": SINGLE, "pairwise": PAIRWISE}


class JudgeTemplate:
    """A compiled template: `render(prompt=..., completion=..., reference=...) -> str`."""

    def __init__(self, source: str, fmt: Literal["jinja", "format"], compare: Compare):
        self.source, self.fmt, self.fields = source, fmt, FIELDS[compare]
        if fmt == "jinja":
            from jinja2 import StrictUndefined, TemplateSyntaxError
            from jinja2.sandbox import SandboxedEnvironment

            try:
                self._jinja = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True
                                                   ).from_string(source)
            except TemplateSyntaxError as err:
                raise ScorerConfigError(f"the judge's Jinja template does not parse: {err}") from None
        else:
            self._check_format_fields()
        self._dry_run()

    @classmethod
    def from_config(cls, cfg: JudgeConfig) -> JudgeTemplate:
        if cfg.template_path is not None:
            path = Path(cfg.template_path).expanduser()
            if not path.is_file():
                raise ScorerConfigError(f"judge template_path {path} does not exist")
            source = path.read_text()
        else:
            source = cfg.template if cfg.template is not None else SHIPPED[cfg.compare]
            if cfg.template is None and cfg.template_format == "format":
                raise ScorerConfigError("the shipped judge templates are Jinja: give your own `template` "
                                        "with template_format: format, or leave template_format: jinja")
        return cls(source, cfg.template_format, cfg.compare)

    def render(self, **values: str) -> str:
        if self.fmt == "jinja":
            return self._jinja.render(**values)
        return self.source.format(**values)

    def _check_format_fields(self) -> None:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(self.source) if name is not None}
        except ValueError as err:
            raise ScorerConfigError(f"the judge's str.format template does not parse: {err}") from None
        unknown = sorted({n.split(".")[0].split("[")[0] for n in names} - set(self.fields))
        if unknown or "" in names:
            raise ScorerConfigError(f"the judge's template names {unknown or ['{}']}; it can use "
                                    f"{', '.join('{' + f + '}' for f in self.fields)}")

    def _dry_run(self) -> None:
        """Render once with every field set, so a name it does not know fails now, with what it can use."""
        from jinja2 import UndefinedError
        from jinja2.exceptions import SecurityError

        try:
            self.render(**{f: f"<{f}>" for f in self.fields})
        except (UndefinedError, SecurityError, KeyError, IndexError, AttributeError) as err:
            raise ScorerConfigError(f"the judge's template uses something it is not given ({err}); it can "
                                    f"use {', '.join(self.fields)}") from None
