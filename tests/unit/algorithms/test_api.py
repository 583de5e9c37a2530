"""The public surface other code relies on: every name exported, every string option a Literal."""

from typing import get_args

import pytest

import asyncrlhf.algorithms as algorithms
from asyncrlhf.algorithms import dpo, kl, offpolicy, reinforce

pytestmark = pytest.mark.unit


def test_every_exported_name_exists():
    missing = [name for name in algorithms.__all__ if not hasattr(algorithms, name)]
    assert missing == []


@pytest.mark.parametrize(
    "literal, table",
    [
        (dpo.DPOLossType, dpo._LOSSES),
        (kl.KLKind, kl._KL_KINDS),
        (offpolicy.ImportanceKind, offpolicy._IMPORTANCE_KINDS),
        (reinforce.Normalization, reinforce._NORMALIZATIONS),
    ],
)
def test_literal_types_match_the_implemented_options(literal, table):
    assert list(get_args(literal)) == list(table)
