"""`asyncrlhf bench mismatch`'s arguments: engine:trainer dtype pairs, and what a wrong one is told."""

import pytest

from asyncrlhf.bench.mismatch import DEFAULT_PAIRS, main, parse_pairs

pytestmark = pytest.mark.unit


def test_pairs_are_engine_then_trainer_in_order():
    assert parse_pairs(DEFAULT_PAIRS) == [("float32", "float32"), ("bfloat16", "bfloat16"),
                                          ("bfloat16", "float32")]
    assert parse_pairs(" float16:float32 ,") == [("float16", "float32")]


@pytest.mark.parametrize("pairs", ["bf16:float32", "float32", "float32:float32:float32", ","])
def test_a_wrong_pair_is_refused_with_an_example(pairs):
    with pytest.raises(ValueError, match="e.g. float32:float32"):
        parse_pairs(pairs)


def test_the_command_line_refuses_a_wrong_pair_before_starting_an_engine(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "configs/tiny.yaml", "--pairs", "fp8:float32"])
    assert exit_.value.code == 2
    assert "fp8:float32" in capsys.readouterr().err
