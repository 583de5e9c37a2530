"""Look up a function by its string name and fail with the valid names listed."""

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], key: str, argument: str) -> T:
    """Return ``table[key]``; on an unknown key raise a ValueError naming ``argument`` and the options."""
    try:
        return table[key]
    except KeyError:
        options = ", ".join(repr(name) for name in table)
        raise ValueError(f"unknown {argument} {key!r}; valid options: {options}") from None
