"""Which policy version sampled each completion token: the one reading of `Sample.token_versions`.

In batch mode weights never change mid-group, `token_versions` is empty and every token was sampled by the
group's `policy_version`. In continuous mode a push lands between two engine steps, so one sample's tokens
can span several versions (non-decreasing, within the group's lineage), and `policy_version` is the oldest
of them. The learner judges a group's staleness on its oldest token (`oldest_version`) and corrects each
token by its own version.
"""

from __future__ import annotations

from asyncrlhf._proto.rollout_pb2 import RolloutGroup, Sample
from asyncrlhf.version import PolicyVersion


def sample_versions(sample: Sample, group_version: int) -> list[int]:
    """The version of each completion token: `token_versions`, or `group_version` for every token."""
    if sample.token_versions:
        return list(sample.token_versions)
    return [group_version] * len(sample.completion_token_ids)


def version_span(group: RolloutGroup) -> tuple[int, int]:
    """(oldest, newest) version that sampled a token of the group. The oldest is the minimum of
    `policy_version` and every token's, so a generator that set `policy_version` inconsistently cannot make a
    group look fresher than its oldest token."""
    versions = [v for s in group.samples for v in s.token_versions]
    return min([group.policy_version, *versions]), max([group.policy_version, *versions])


def oldest_version(group: RolloutGroup) -> int:
    """The oldest version that sampled a token of the group: what its staleness is judged on."""
    return version_span(group)[0]


def token_versions_problem(group: RolloutGroup, current: PolicyVersion) -> str | None:
    """Why the group's `token_versions` cannot be trusted, or None: a length other than the completion's, a
    version that decreases along a sample, or (within the learner's lineage `current`) one newer than the
    learner's own version, which no generator can hold."""
    comparable = PolicyVersion(group.lineage, 0).same_lineage(current)
    for i, s in enumerate(group.samples):
        versions = list(s.token_versions)
        if not versions:
            continue
        if len(versions) != len(s.completion_token_ids):
            return f"sample {i}: {len(versions)} token versions for {len(s.completion_token_ids)} tokens"
        for t in range(1, len(versions)):
            if versions[t] < versions[t - 1]:
                return (f"sample {i}: token versions decrease ({versions[t]} after {versions[t - 1]} at "
                        f"token {t})")
        if comparable and versions[-1] > current.step:
            return (f"sample {i}: a token sampled by version {versions[-1]}, newer than the learner's "
                    f"{current.step}")
    return None
