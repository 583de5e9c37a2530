"""`asyncrlhf audit RUN_DIR [overrides]`: did every prompt group the learner enqueued end exactly once?

The learner enqueues groups `g00000000 .. g<cursor-1>` (the cursor is the run's `FEED_CURSOR` key in
Redis) and appends every group it trains, drops as stale or counts as dead-lettered to
`<run dir>/consumed.jsonl` (fsynced before the ack). The audit joins the two with what Redis still holds:

    trained        in consumed.jsonl as `trained`, exactly once
    dropped        in consumed.jsonl as `dropped` (staleness over learner.max_staleness)
    filtered       in consumed.jsonl as `filtered` (learner.dynamic_sampling: rewards all equal, refilled)
    dead-lettered  in consumed.jsonl as `dead_lettered`, or in the dead-letter stream (with its reason) and
                   not yet counted by the learner (a dead-lettered duplicate of a group that was trained
                   ended as trained: the learner trains an id at most once)
    in flight      still an entry of the prompts, rollouts or scored stream (pending or not yet read)
    lost           none of these: a failure
    trained twice  a failure; so is a group that ended in two ways (e.g. dead-lettered and trained)
    update lost    trained, but only in lineages outside the final model's history (after the checkpoint a
                   restarted learner resumed from) and neither trained again nor in flight (dropped or
                   dead-lettered afterwards included): a failure

Trained means trained *in the final model's history* (see `asyncrlhf.consumed`): the lineage of the last
learner start, then each parent lineage up to the checkpoint version its child resumed from. A group trained
after that checkpoint is in no model; the restarted learner enqueued it again (a `requeued` row), and it
counts once it is trained in the history. The report lists every lineage: where it began, what it trained
and how much of it the final model holds.

In flight is not a loss: a running run always has some, and a finished one keeps what the learner had
enqueued beyond its last step (a resumed run trains them). Either way there may be at most the credit bound,
`(max_staleness + 1) * groups_per_step`; more is a failure. The exit code is 0 when nothing failed, 1
otherwise, 2 for a usage or config error.

The package:

    accounting  `Audit` and `account`: the rules above, pure
    lineages    each lineage's origin, what it trained, what the final model holds
    run         reading a run: its consumed log and its Redis (or a copy of its append-only file)
    command     `asyncrlhf audit`: arguments, report, exit code
"""

from asyncrlhf.audit.accounting import Audit, account, account_saved
from asyncrlhf.audit.command import format_audit, load_audit_config, main
from asyncrlhf.audit.run import audit_run, connect_for_audit

__all__ = ["Audit", "account", "account_saved", "audit_run", "connect_for_audit", "format_audit",
           "load_audit_config", "main"]
