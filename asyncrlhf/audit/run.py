"""Reading a run for the audit: its consumed log, and what its Redis holds (the feed cursor, the dead letters,
the flow streams, the events, saved progress). Where Redis is: `redis.url` or the sentinels' primary, else a
throw-away copy of `<run dir>/redis` (the append-only file) loaded into an embedded server, so the audit
never writes to the run's own files and works while the run is live."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from asyncrlhf.audit.accounting import FLOW_STREAMS, Audit, account, account_saved
from asyncrlhf.config import Config, ConfigError
from asyncrlhf.consumed import read_rows
from asyncrlhf.streams import EVENTS, FEED_CURSOR, ID_FIELD, PARTIALS, PAYLOAD_FIELD, RunStreams, connect
from asyncrlhf.streams.names import group_of_identity


def audit_run(cfg: Config, client) -> Audit:
    """The audit of `cfg`'s run, from Redis (`client`, bytes responses) and its consumed.jsonl."""
    from asyncrlhf._proto.events_pb2 import EVENT_KIND_RUN_FINISHED, Event
    streams = RunStreams(client, cfg.run.name)
    enqueued = int(client.get(streams.key(FEED_CURSOR)) or 0)
    dead = [(d.stream, d.identity, d.reason) for d in streams.dead_letters(count=None)]
    in_flight = {
        name: {group_of_identity(f.get(ID_FIELD, b"").decode(errors="replace"))
               for _, f in client.xrange(streams.key(name))}
        for name in FLOW_STREAMS
    }
    finished = False
    for _, fields in client.xrange(streams.key(EVENTS.name)):
        event = Event()
        try:
            event.ParseFromString(fields.get(PAYLOAD_FIELD, b""))
        except Exception:  # a malformed event says nothing about the run
            continue
        finished = finished or event.kind == EVENT_KIND_RUN_FINISHED
    bound = (cfg.learner.max_staleness + 1) * cfg.learner.groups_per_step
    consumed = read_rows(cfg.run.path)
    enqueued_by_end = int(client.get(streams.key(FEED_CURSOR)) or 0)  # a live learner went on meanwhile
    audit = account(enqueued, consumed, dead, in_flight, finished=finished, credit_bound=bound,
                    enqueued_by_end=enqueued_by_end)
    saved = [k.decode(errors="replace") for k in client.hkeys(streams.key(PARTIALS))]
    return account_saved(audit, saved, consumed, max(enqueued, enqueued_by_end))


def connect_for_audit(cfg: Config, stack: ExitStack):
    """A client to the run's Redis: `redis.url` or the sentinels' primary, else an embedded server on a copy
    of the run's AOF."""
    from asyncrlhf.redis_server import EmbeddedRedis

    if cfg.redis.external:
        return connect(cfg.redis, retries=2)
    aof = cfg.run.path / "redis"
    if not aof.is_dir():
        raise ConfigError(
            f"no redis.url and no append-only file in {aof}: pass redis.url=redis://HOST:PORT/0 "
            "of the run's Redis"
        )
    copy = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrlhf-audit-"))) / "redis"
    shutil.copytree(aof, copy, ignore=shutil.ignore_patterns("redis.log", "*.sock"))
    server = stack.enter_context(EmbeddedRedis(copy, password=cfg.redis.password))
    return connect(cfg.redis, server.url, retries=2)
