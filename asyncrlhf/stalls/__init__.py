"""Stalls that name their cause: what each service waits on (`waiting`), the evidence Redis holds about the
pipeline (`evidence`), the pure judgement from evidence to a message naming the hop (`diagnosis`), and the
monitor that the learner and `asyncrlhf up` both run (`monitor`). docs/stalls.md is the operator's page."""

from asyncrlhf.stalls.diagnosis import Cause, Evidence, Flow, Hop, Replica, Stall, diagnose
from asyncrlhf.stalls.waiting import Wait, Waiting, WaitState

__all__ = ["Cause", "Evidence", "Flow", "Hop", "Replica", "Stall", "Wait", "WaitState", "Waiting", "diagnose"]
