"""`generator.tensor_parallel_size`: vLLM only, and no more GPUs asked for than a replica is given."""

import pytest

from asyncrlhf.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_tensor_parallel_with_vllm_and_enough_gpus_loads():
    cfg = load_config(["configs/tiny.yaml"], ["generator.backend=vllm", "generator.tensor_parallel_size=2",
                                              "model.tiny.heads=2",
                                              "launch.gpus={generator: '0,1', learner: '2,3'}"])
    assert cfg.generator.tensor_parallel_size == 2


def test_tensor_parallel_needs_the_vllm_backend():
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs generator.backend=vllm"):
        load_config(["configs/tiny.yaml"], ["generator.tensor_parallel_size=2"])


def test_tensor_parallel_needs_as_many_gpus_as_it_shards_over():
    with pytest.raises(ConfigError, match="needs 4 GPUs per generator replica.*launch.gpus.generator='0,1'"):
        load_config(["configs/tiny.yaml"], ["generator.backend=vllm", "generator.tensor_parallel_size=4",
                                            "model.tiny.heads=2", "launch.gpus={generator: '0,1'}"])
