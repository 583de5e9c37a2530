"""A language model as the judge (docs/judges.md): a reward scorer (`reward.scorers[].kind: judge`) and the
evaluator's judged win rate (`evaluator.judge`).

    template.py  the judge's prompt (Jinja or str.format, inline or a file)
    engine.py    who answers: the protocol, and an engine in this process (vLLM, or transformers)
    endpoint.py  ... or any OpenAI-compatible server (bounded in flight, timeout and retries per call)
    reply.py     how a reply becomes a value (a number, a label, a token's probability)
    cache.py     replies by the hash of the rendered request
    meter.py     what the judge reports (the reward service's metrics implement it)
    judge.py     all of it: requests -> values
    scorer.py    the scorer: single answers, or pairwise within a prompt's group
"""

from asyncrlhf.rewards.judge.judge import Judge
from asyncrlhf.rewards.judge.meter import JudgeMeter, NullMeter
from asyncrlhf.rewards.judge.scorer import JudgeScorer

__all__ = ["Judge", "JudgeMeter", "JudgeScorer", "NullMeter"]
