"""Run under torchrun (2 ranks, gloo): for each ZeRO stage 0-3 of a user DeepSpeed JSON, full and LoRA,
train a few steps, then push the weights the learner gathers to a real WeightSync receiver and check they
equal the weights gathered all at once. Rank 0 writes one JSON line per case to argv[1]."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from asyncrlhf.config import load_config
from asyncrlhf.models import ReferencePolicy, load_policy
from asyncrlhf.training import engine
from asyncrlhf.training.objectives import make_objective
from asyncrlhf.training.policies import LearnerModels
from asyncrlhf.training.trainer import Trainer
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import ModuleTarget
from tests.integration.learner.groups import scored_groups, train_groups

BETAS, LR = [0.8, 0.95], 1e-3


def user_json(path: str, stage: int) -> str:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": BETAS, "eps": 1e-8,
                                                        "weight_decay": "auto"}}}
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def case(stage: int, lora: bool, rank: int, out_dir: str) -> dict:
    path = user_json(f"{out_dir}/ds_zero{stage}-rank{rank}.json", stage)  # one each: a shared file raced
    cfg = load_config(["configs/tiny.yaml"], [f"learner.deepspeed.config_file={path}",
                                              f"learner.lora.enabled={str(lora).lower()}",
                                              "learner.lora.target_modules=[q_proj,v_proj]"])
    lc = engine.effective_learner(cfg.learner)
    cfg = cfg.model_copy(update={"learner": lc})
    torch.manual_seed(0)
    policy = engine.initialize(load_policy(cfg.model, lora=lc.lora), lc)
    group = engine.optimizer_of(policy).param_groups[0]
    reference = ReferencePolicy(policy.module if lora else load_policy(cfg.model))
    trainer = Trainer(cfg, LearnerModels(policy, reference, None), objective=make_objective(cfg), pad_id=0,
                      rank=rank, world=2)
    before = engine.full_state_dict(policy.module, lc.deepspeed.zero_stage, lora)
    for step in range(2):
        trainer.train_step(train_groups(scored_groups(4, 2, seed=step)), step_seed=step)
    pushed = engine.full_state_dict(policy.module, lc.deepspeed.zero_stage, lora)
    with engine.gathered(policy.module, lc.deepspeed.zero_stage):
        state = policy.module.state_dict()
        whole = {k: v.detach().clone() for k, v in state.items() if not lora or "lora_" in k}
    result = {"stage": stage, "lora": lora, "effective_stage": lc.deepspeed.zero_stage,
              "engine_stage": policy.zero_optimization_stage(), "lr": group["lr"],
              "betas": list(group["betas"]),
              "optimizer": type(engine.optimizer_of(policy)).__name__,
              "settings": engine.effective_settings(policy, lc)}
    if rank == 0:
        result.update(push_and_compare(cfg, lc, pushed, whole, before))
    return result


def push_and_compare(cfg, lc, pushed, whole, before) -> dict:
    live = load_policy(cfg.model, lora=lc.lora)
    names = [n for n in live.state_dict() if "lora_" in n] if lc.lora.enabled else None
    receiver = WeightReceiver(ModuleTarget(live, names))
    server, port = serve(receiver, "127.0.0.1", 0)
    try:
        with WeightPusher(chunk_bytes=64 << 10) as pusher:
            (outcome,) = pusher.push(pushed, PolicyVersion(0, 2), [PushTarget("g0", f"127.0.0.1:{port}")])
    finally:
        server.stop(0).wait()  # gRPC's threads down before the next case (and before exit)
    received = {k: v for k, v in live.state_dict().items() if names is None or k in names}
    return {
        "push": outcome.status, "detail": outcome.detail,
        "same_names": sorted(received) == sorted(whole) == sorted(pushed),
        "received_equals_gathered": all(torch.equal(received[k], whole[k]) for k in whole),
        "nonempty": all(t.numel() > 0 for t in pushed.values()),
        "trained": any(not torch.equal(before[k], pushed[k]) for k in pushed),
        "tensors": len(pushed),
    }


def main() -> None:
    out_dir = sys.argv[1]
    rank, world = engine.init_distributed()
    assert world == 2
    results = [case(stage, lora, rank, out_dir) for stage in (0, 1, 2, 3) for lora in (False, True)]
    dist.barrier()
    if rank == 0:
        with open(f"{out_dir}/results.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # Results are on disk: leave without C++ static destructors, where a gRPC/gloo thread still joinable
    # can abort the process ("terminate called without an active exception") and fail a finished run.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
