"""What every config section is built from: `Section` (unknown keys fail), `Tagged` (a union of sections told
apart by one field, such as `learner.algorithm` or a scorer's `kind`) and `ConfigError`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema


class ConfigError(ValueError):
    """A config that cannot be used; the message says which key and what to do."""


class Section(BaseModel):
    """Base of every section: unknown keys fail, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def misplaced(cls, key: str, prefix: str, data: Mapping[str, Any]) -> str | None:
        """For a `key` this section does not have: a message naming where it lives now, if it moved
        (`prefix` is the section's dotted path with its trailing dot, `data` the section as written)."""
        return None


@dataclass(frozen=True)
class Tagged:
    """Metadata of a union of sections told apart by the value of one field, the tag:

        ScorerConfig = Annotated[RuleScorerConfig | ModelScorerConfig | RemoteScorerConfig, Tagged("kind")]

    Each member declares the tag as a `Literal` of the values it takes. pydantic validates the union by the
    tag's value (`default` when the tag is absent); the key walker reads the same members to say which member
    a misplaced key belongs to."""

    tag: str
    default: str | None = None

    def members(self, union: Any) -> dict[str, type[Section]]:
        """Tag value -> the member that takes it."""
        return {
            value: member
            for member in get_args(union)
            for value in get_args(member.model_fields[self.tag].annotation)
        }

    def value(self, data: Any) -> Any:
        """The tag's value in raw data (a mapping) or in a built section."""
        if isinstance(data, Mapping):
            return data.get(self.tag, self.default)
        return getattr(data, self.tag, None)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        members = self.members(source)

        def pick(data: Any) -> str | None:
            value = self.value(data)
            return value if isinstance(value, str) and value in members else None

        return core_schema.tagged_union_schema(
            {value: handler.generate_schema(member) for value, member in members.items()},
            pick,
            custom_error_type="invalid_tag",
            custom_error_message=f"`{self.tag}` must be one of {', '.join(members)}",
        )
