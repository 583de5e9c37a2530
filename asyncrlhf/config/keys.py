"""Keys as a user writes them: every key of a config (YAML files merged with overrides) is checked against
the section tree before pydantic sees the values, so a typo or a misplaced knob fails with its full dotted
path and what to write instead. The walk follows a tagged union (`learner` by `algorithm`, a scorer by `kind`)
into the member the data picks; `key_path` spells pydantic's error locations the same way."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from asyncrlhf.config.base import ConfigError, Section, Tagged


@dataclass(frozen=True)
class Slot:
    """What a field holds, as far as keys go: one section or a tagged union of sections; maybe a list."""

    held: Any  # the section, or the union of the members
    tagged: Tagged | None
    many: bool

    def members(self) -> dict[str, type[Section]]:
        return self.tagged.members(self.held) if self.tagged else {}

    def section(self, item: Mapping[str, Any], path: str) -> type[Section]:
        """The section that `item`, written at `path`, is checked against."""
        if self.tagged is None:
            return self.held
        members, value = self.members(), self.tagged.value(item)
        if not isinstance(value, str) or value not in members:
            got = "is missing" if value is None else f"is {value!r}"
            raise ConfigError(f"`{path}.{self.tagged.tag}` {got}; write one of {', '.join(members)}")
        return members[value]


def field_slot(field: FieldInfo) -> Slot | None:
    held, metadata = field.annotation, list(field.metadata)
    if get_origin(held) in (Union, UnionType) and type(None) in get_args(held):  # an optional section
        held = next(arg for arg in get_args(held) if arg is not type(None))
    many = get_origin(held) is list
    if many:
        (held,) = get_args(held)
        if get_origin(held) is Annotated:
            held, *metadata = get_args(held)
    tagged = next((m for m in metadata if isinstance(m, Tagged)), None)
    if tagged is not None or (isinstance(held, type) and issubclass(held, Section)):
        return Slot(held, tagged, many)
    return None


def check_keys(
    data: Mapping[str, Any], section: type[Section], prefix: str = "", slot: Slot | None = None
) -> None:
    """Unknown keys fail with the full dotted path and where the key belongs, or the closest known key
    (`slot`: the union `section` was picked from, if any)."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        field = section.model_fields.get(key)
        if field is None:
            raise ConfigError(_unknown(key, path, prefix, data, section, slot))
        inner = field_slot(field)
        if inner is None:
            continue
        for where, item in _items(value, path, inner.many):
            if isinstance(item, Mapping):
                check_keys(item, inner.section(item, where), f"{where}.", inner)


def _items(value: Any, path: str, many: bool) -> list[tuple[str, Any]]:
    if not many:
        return [(path, value)]
    return [(f"{path}[{i}]", item) for i, item in enumerate(value)] if isinstance(value, list) else []


def _unknown(
    key: str, path: str, prefix: str, data: Mapping[str, Any], section: type[Section], slot: Slot | None
) -> str:
    moved = section.misplaced(key, prefix, data)
    if moved:
        return moved
    if slot is not None and slot.tagged is not None:
        tag = slot.tagged.tag
        owners = [value for value, member in slot.members().items() if key in member.model_fields]
        if owners:
            here = slot.tagged.value(data)
            return f"`{path}` belongs to `{tag}: {' | '.join(owners)}`, but `{prefix}{tag}` is `{here}`"
    known = list(section.model_fields)
    guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean `{prefix}{guess[0]}`?" if guess else f"; known keys: {', '.join(known)}"
    return f"unknown key `{path}`{hint}"


def key_path(loc: Sequence[str | int], root: type[Section]) -> tuple[str, FieldInfo | None]:
    """pydantic's error location as the user writes it (`reward.scorers[0].name`: list indices in brackets,
    without the tag pydantic inserts after a tagged union), and the field it ends at, if known."""
    text, rest = "", list(loc)
    section: type[Section] | None = root
    field: FieldInfo | None = None
    while rest:
        item = rest.pop(0)
        if isinstance(item, int):
            text += f"[{item}]"
            continue
        text += f".{item}" if text else item
        field = section.model_fields.get(item) if section else None
        slot = field_slot(field) if field else None
        if slot and slot.many and rest and isinstance(rest[0], int):
            text += f"[{rest.pop(0)}]"
        if slot and slot.tagged:
            section = slot.members().get(str(rest.pop(0))) if rest else None
        else:
            section = slot.held if slot else None
    return text, field
