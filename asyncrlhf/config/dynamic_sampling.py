"""`learner.dynamic_sampling`: groups whose rewards carry no signal are filtered out and the step is refilled
(DAPO's dynamic sampling; `asyncrlhf.inbox.informative`)."""

from __future__ import annotations

from pydantic import Field

from asyncrlhf.config.base import Section


class DynamicSamplingConfig(Section):
    """Filter uninformative groups (every reward equal: zero variance, or a tied best/worst pair for online
    DPO and best-of-n) and refill the step with further groups, so every step trains `groups_per_step`
    informative ones."""

    enabled: bool = Field(False, description="Filter groups whose rewards are all equal; refill the step.")
    refill_cap: float = Field(
        3.0, gt=0, description="At most this many times groups_per_step groups are filtered in one step; "
        "then the step trains what it has (with nothing informative yet, it stops filtering and fills up). "
        "3: a step reads up to 4x its groups, enough while at most 75% of groups are uninformative; beyond "
        "that the task teaches little and waiting for more would stall the run.")
