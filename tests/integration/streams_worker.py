"""A generator-like consumer run as a real process by test_streams.py (so it can be SIGKILLed).

python -m tests.integration.streams_worker URL RUN CONSUMER [--stall-on-batch N]

Reads prompt groups in batches of 5 and acks each with a RolloutGroup written to `rollouts`. With
`--stall-on-batch N` it marks `asyncrlhf:<run>:stalled:<consumer>` after reading its N-th batch and then
hangs without acking, to be killed mid-batch.
"""

from __future__ import annotations

import argparse
import time

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.config import RedisConfig
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, ROLLOUTS, RunStreams, connect


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("run")
    parser.add_argument("consumer")
    parser.add_argument("--stall-on-batch", type=int, default=0)
    args = parser.parse_args()
    cfg = RedisConfig(claim_idle_ms=300, block_ms=100)
    streams = RunStreams(connect(cfg, args.url), args.run, cfg)
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, args.consumer)
    rollouts = streams.producer(ROLLOUTS)
    batches = 0
    while True:
        batch = consumer.read(5)
        if not batch:
            continue
        batches += 1
        if batches == args.stall_on_batch:
            streams.client.set(streams.key(f"stalled:{args.consumer}"), len(batch))
            time.sleep(3600)
        time.sleep(0.01)  # "generation"
        outputs = [RolloutGroup(group_id=d.identity, prompt=d.message, generator_id=args.consumer)
                   for d in batch]
        consumer.ack(batch, outputs, rollouts)


if __name__ == "__main__":
    main()
