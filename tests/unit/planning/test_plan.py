"""`asyncrlhf plan`: the 4-GPU node's config fits its node, and a run that does not fit is refused (exit 1)
with the reason: a GPU the node lacks, a vLLM share too small for its model, a GPU over its memory."""

import pytest

from asyncrlhf.cli import main
from asyncrlhf.config import load_config
from asyncrlhf.planning import memory as mem
from asyncrlhf.planning.plan import make_plan

pytestmark = pytest.mark.unit
NODE = "configs/node4gpu.yaml"


def plan_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_4_gpu_node_config_fits_4_gpus_with_the_evaluator_beside_the_generator(capsys):
    code, out = plan_cli(capsys, NODE, "--gpus", "4", "--gpu-memory", "80")
    assert code == 0, out
    assert out.splitlines()[-1] == "fits"
    plan = make_plan(load_config([NODE]), gpus=4, gpu_bytes=80 * mem.GIB)
    where = {p.service: p.devices for p in plan.processes}
    assert where == {"generator-0": ("gpu 0",), "reward-0": ("gpu 0",), "learner": ("gpu 1",),
                     "learner rank 1": ("gpu 2",), "learner rank 2": ("gpu 3",), "evaluator": ("gpu 0",)}
    used = plan.used()
    assert used["gpu 0"] > 0.7 * 80 * mem.GIB  # vLLM's share, and the evaluator in what it leaves
    assert set(used) == {"gpu 0", "gpu 1", "gpu 2", "gpu 3", "cpu"}


def test_a_run_that_needs_a_fifth_gpu_is_refused_naming_it(capsys):
    code, out = plan_cli(capsys, NODE, "--gpus=4", "launch.learner_procs=4", "launch.gpus.learner=1,2,3,4")
    assert code == 1, out
    assert "does not fit:" in out
    assert "launch.gpus.learner='1,2,3,4' names GPU 4, but the node has 4 GPUs (0-3)" in out


def test_a_vllm_share_too_small_for_its_model_is_refused_with_what_to_change(capsys):
    code, out = plan_cli(capsys, NODE, "--gpus", "4", "generator.vllm.gpu_memory_utilization=0.01")
    assert code == 1, out
    share = "vLLM's share (generator.vllm.gpu_memory_utilization=0.01 of 80.0 GiB = 0.8 GiB) cannot hold"
    assert share in out


def test_a_gpu_over_its_memory_is_refused_naming_what_fills_it():
    cfg = load_config(["configs/tiny.yaml"])  # generator, learner and evaluator on `auto`: GPU 0
    plan = make_plan(cfg, gpus=1, gpu_bytes=mem.GIB // 2)  # a process's CUDA context alone takes 1 GiB
    assert not plan.fits
    refusal = plan.refusals()[0]
    assert refusal.startswith("gpu 0 needs 3.0 GiB of its 0.5 GiB: generator-0 CUDA context and allocator "
                              "1.0, learner CUDA context and allocator 1.0, evaluator CUDA context"), refusal
    assert refusal.endswith("(move a service to another GPU with launch.gpus, or shrink what holds the most)")


def test_a_gpu_setting_on_a_machine_without_gpus_says_how_to_plan_for_a_node(capsys):
    code, out = plan_cli(capsys, NODE, "--gpus", "0")
    assert code == 1
    assert "generator.device=cuda needs GPU 1 of those it sees, but it sees 0" in out
    assert "plan for a GPU node with --gpus N --gpu-memory GiB" in out


def test_bad_flags_are_refused_saying_how_to_write_them(capsys):
    code, out = plan_cli(capsys, NODE, "--gpus", "four")
    assert code == 2 and "--gpus takes a whole number" in out
    code, out = plan_cli(capsys, NODE, "--gpu-memory")
    assert code == 2 and "--gpu-memory needs a value" in out


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="gpu: up plans only on a GPU machine")
def test_up_on_a_gpu_machine_refuses_a_run_that_names_a_gpu_it_lacks():
    import torch

    from asyncrlhf.prestart import plan_refusal

    count = torch.cuda.device_count()
    cfg = load_config(["configs/tiny.yaml"], [f"launch.gpus.learner={count}"])
    refusal = plan_refusal(cfg, ["configs/tiny.yaml"])
    assert refusal is not None and f"names GPU {count}" in refusal and "launch.check_plan=false" in refusal
    assert plan_refusal(load_config(["configs/tiny.yaml"], ["launch.check_plan=false",
                                                            f"launch.gpus.learner={count}"]), []) is None


def test_a_judge_in_the_reward_replica_holds_its_engine_there_and_one_behind_an_endpoint_holds_nothing():
    cfg = load_config([NODE], ["reward.scorers=[{kind: judge, model: {name_or_path: tiny}, "
                               "engine: {gpu_memory_utilization: 0.3}}]"])
    plan = make_plan(cfg, gpus=4, gpu_bytes=80 * mem.GIB)
    judged = [d for d in plan.demands if d.service == "reward-0" and "judge" in d.item]
    assert [(d.device, d.bytes) for d in judged] == [("gpu 0", int(0.3 * 80 * mem.GIB))]  # vLLM's share
    assert not plan.fits  # the generator's 0.7 and the judge's 0.3 of GPU 0 leave nothing for a context
    assert "reward-0 judge tiny: vLLM's share (gpu_memory_utilization 0.30) 24.0" in plan.refusals()[0]
    remote = load_config([NODE], ["reward.scorers=[{kind: judge, endpoint: {url: 'http://judge:8000/v1'}}]"])
    assert not [d for d in make_plan(remote, gpus=4, gpu_bytes=80 * mem.GIB).demands if "judge" in d.item]
