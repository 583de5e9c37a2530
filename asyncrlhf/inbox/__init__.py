"""The learner's inbox: what rank 0 enqueues, reads, admits and ends.

    ids         group ids `g<cursor>` (their one owner)
    prompts     the training prompts in the feed's order (shared with the in-process baseline)
    feed        enqueueing under the in-flight bound, the cursor in Redis
    admission   `admit(...) -> Verdict`: de-duplicate, validate, judge staleness (pure)
    strategy    how a step is collected: `Bounded` (bound), `Windowed` (exact, paper)
    recovery    Redis brought in line with the consumed log at a start and after a restart or failover
    endings     the one place a group ends (trained, dropped, filtered, dead-lettered), and its credits
    inbox       `Inbox`: a step's collection, admission of each delivery, the tick, the release after a push

Import from the modules (`asyncrlhf.inbox.ids` stays light: the audit and the benches read ids without
loading the learner's dependencies).
"""
