import json

import pytest

from asyncrlhf.bench.generator import main

pytestmark = pytest.mark.integration


def test_bench_compares_service_and_bare_on_the_same_samples(capsys):
    assert main(["--config", "configs/tiny.yaml", "--prompts", "8", "--repeats", "1", "--json",
                 "generator.device=cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    (round_,) = result["rounds"]
    # same seed per phase: the service wrote exactly the tokens the bare backend sampled
    assert round_["service_tokens"] == round_["bare_tokens"] > 0
    assert result["bare_tokens_per_s"] > 0 and result["service_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["service_tokens_per_s"] / result["bare_tokens_per_s"])
