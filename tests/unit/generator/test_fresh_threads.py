"""Torch work from a long-lived thread (a gRPC handler applying a push, a web server worker sampling for the
API) must not leave an OpenMP worker pool behind (why: `asyncrlhf.cores.on_fresh_thread`). `WeightSwap`
applies, and `ApiSampler` samples, on a thread that exits. Each case runs in a fresh interpreter, so no
earlier test's OpenMP state counts."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, threading, time, torch
from asyncrlhf.sampling import Completion
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.serving.openai.engine import ApiSampler, Params
from asyncrlhf.serving.openai.limits import PromptLimits
from services.generator.metrics import GeneratorMetrics
from services.generator.server import WeightSwap
from asyncrlhf.version import PolicyVersion

torch.set_num_threads(2)
a = torch.randn(1500, 1500)
(a @ a).sum()  # the compute thread's own pool

class Backend:
    version = 0
    def apply_weights(self, tensors, version, adopt=False):
        (a @ a).sum()  # a parallel region, like a LoRA merge
        self.version = version.step
        return {}
    def generate(self, prompts, n, sampling):
        (a @ a).sum()  # a parallel region, like a decoding step
        return [[Completion([7, 8], [-0.5, -0.25], "length") for _ in range(n)] for _ in prompts]

class Tokenizer:
    def __len__(self):
        return 100
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))

backend = Backend()
backend.version = 1
sampler = ApiSampler(backend, BackendGate(), Tokenizer(), PromptLimits(16, "test"))
params = Params(max_tokens=2, temperature=1.0, top_p=1.0, seed=0, stops=[])

swap = WeightSwap(Backend(), BackendGate(), GeneratorMetrics("gen-t"))
applied, release = threading.Event(), threading.Event()

def handler():  # stays alive, as gRPC's handler threads and the web server's workers do
    if MODE == "swap":
        swap.apply_weights({}, PolicyVersion(0, 1))
    elif MODE == "api":
        version, choices = sampler.sample([[1, 2, 3]], 2, params)
        assert version == 1 and [c.token_ids for c in choices[0]] == [[7, 8], [7, 8]], choices
    else:
        Backend().apply_weights({}, PolicyVersion(0, 1))
    applied.set()
    release.wait()

before = len(os.listdir("/proc/self/task"))
thread = threading.Thread(target=handler)
thread.start()
applied.wait()
deadline = time.monotonic() + 5  # a thread that exited takes its OpenMP pool down shortly after
while (after := len(os.listdir("/proc/self/task"))) > before + 1 and time.monotonic() < deadline:
    time.sleep(0.05)
release.set()
thread.join()
print(json.dumps({"extra_threads": after - before, "version": swap.backend.version}))
"""


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", f"MODE = {mode!r}\n" + SCRIPT], capture_output=True,
                          text=True, timeout=120, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_swap_from_a_long_lived_thread_leaves_only_that_thread():
    bare = run("direct")
    assert bare["extra_threads"] == 2  # the handler and the OpenMP pool it kept: what the swap must avoid
    swapped = run("swap")
    assert swapped == {"extra_threads": 1, "version": 1}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_an_api_request_from_a_long_lived_worker_leaves_only_that_thread():
    assert run("api")["extra_threads"] == 1
