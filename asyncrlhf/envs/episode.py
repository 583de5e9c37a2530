"""Episodes: model turn -> tool calls parsed -> environment step -> observation appended -> next turn, until
the environment is done, `max_turns`, or the token budget.

Token bookkeeping is exact. The episode's tokens are the model's sampled ids, kept as sampled (never a
re-tokenisation of the conversation's text), with the environment's observations between them, each
tokenised once when it arrives: `token_ids` is what the learner trains on after the prompt, `loss_mask` is
1 on the model's tokens and 0 on the environment's, and every model token keeps its behaviour log-prob and
the policy version that sampled it (environment tokens get log-prob 0 and the version of the turn before
them; the mask keeps both out of the loss).

A model turn that ends by length (no EOS) is closed by an EOS the model did not sample (masked, like an
observation) so the template's next turn can follow. An environment that raises, hangs past
`step_timeout_s` or answers something malformed ends its own episode (`end` says why); the others go on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from asyncrlhf.chat_format import Message, ToolSpec, observation_text, render_chat
from asyncrlhf.config import Config
from asyncrlhf.envs import base
from asyncrlhf.envs.base import EndKind, Env, EnvFailure, EpisodeEnd, StepResult
from asyncrlhf.sampling.backend import Completion, Finish

MAX_PARALLEL_STEPS = 64  # environment steps of one turn run at once, on threads


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int  # completion tokens (model and environment) after the prompt
    max_turn_tokens: int
    step_timeout_s: float
    max_positions: int  # the longest sequence the model takes (prompt + completion)


def episode_limits(cfg: Config, max_turn_tokens: int) -> EpisodeLimits:
    """The run's episode limits (`task.env`), with each model turn up to `max_turn_tokens` (the generator's
    `max_new_tokens`, or the evaluator's)."""
    env = cfg.task.env
    return EpisodeLimits(max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
                         max_turn_tokens=max_turn_tokens, step_timeout_s=env.step_timeout_s,
                         max_positions=max_positions(cfg))


def max_positions(cfg: Config) -> int:
    """The longest sequence (prompt and episode) the policy takes."""
    if cfg.model.name_or_path == "tiny":
        return cfg.model.tiny.max_positions
    if cfg.generator.backend == "vllm" and cfg.generator.vllm.max_model_len:
        return cfg.generator.vllm.max_model_len
    return cfg.model.max_prompt_tokens + cfg.task.env.max_episode_tokens


@dataclass
class Episode:
    env: Env | None  # None for an episode that ended on another generator (handed on as it was)
    tools: list[ToolSpec] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    turn_ends: list[int] = field(default_factory=list)  # one past each ended model turn's last token
    turn_rewards: list[float] = field(default_factory=list)  # each step's reward (their sum: `reward`)
    reward: float = 0.0
    end: EpisodeEnd | None = None  # None while it runs
    finish: Finish = "length"
    step_seconds: list[float] = field(default_factory=list)
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: dict[str, int] = field(default_factory=dict)
    continued_from: int = 0  # leading tokens produced by another generator before a hand-on

    def completion(self) -> Completion:
        return Completion(list(self.token_ids), list(self.logprobs), self.finish, tuple(self.versions),
                          self.continued_from)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int], *,
               model: bool) -> None:
        """Tokens after the episode's so far: the model's (`model`, trained on) or the environment's; one
        version for all, or one per token."""
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids) if isinstance(version, int) else list(version)
        self.loss_mask += [int(model)] * len(ids)


# (contexts, max new tokens) -> (one completion per context, the policy version that sampled them)
Sample = Callable[[list[list[int]], int], tuple[list[Completion], int]]


class EpisodeRunner:
    """Runs the episodes of a batch of prompts together: each turn, every running episode's context is one
    prompt of a single batched `sample` call, then every episode's environment steps at once (a thread
    each), so a turn waits for its slowest step, not for the sum of them. Its per-episode rules (`start`,
    `room`, `take`, `step_env`, `after_step`) also drive the continuous episodes
    (`asyncrlhf.envs.continuous`), one episode at a time."""

    def __init__(self, tokenizer, make_env: Callable[[], Env], limits: EpisodeLimits,
                 system_prompt: str = ""):
        self.tokenizer, self.make_env, self.limits = tokenizer, make_env, limits
        self.system_prompt = system_prompt

    def run(self, prompts: Sequence[tuple[str, str | None]], k: int | Sequence[int],
            sample: Sample) -> list[list[Episode]]:
        """k episodes of each (prompt text, reference) (`k` one for all, or one per prompt): `out[i][j]`."""
        ks = [k] * len(prompts) if isinstance(k, int) else list(k)
        groups = [[self.start(text, reference) for _ in range(n)]
                  for (text, reference), n in zip(prompts, ks, strict=True)]
        episodes = [e for group in groups for e in group]
        while running := [e for e in episodes if e.end is None]:
            room = [self.room(e) for e in running]
            budget = max(room)
            completions, version = sample([e.prompt_ids + e.token_ids for e in running], budget)
            cut = [_cut(c, limit) for c, limit in zip(completions, room, strict=True)]
            actions = [self.take(e, c, version) for e, c in zip(running, cut, strict=True)]
            with ThreadPoolExecutor(max_workers=min(len(running), MAX_PARALLEL_STEPS)) as pool:
                outcomes = list(pool.map(self.step_env, running, actions))
            for episode, completion, outcome in zip(running, cut, outcomes, strict=True):
                self.after_step(episode, completion.finish, outcome)
        return groups

    def start(self, prompt: str, reference: str | None) -> Episode:
        """A new episode: a fresh environment, reset on the prompt, its first context rendered."""
        env = self.make_env()
        episode = Episode(env=env)
        try:
            episode.tools = base.tools_of(env)
            first = base.reset(env, prompt, reference, self.limits.step_timeout_s)
        except EnvFailure as err:
            first, episode.end = [{"role": "user", "content": prompt}], err.end
        episode.prompt_ids = opening_ids(self.tokenizer, first, episode.tools, self.system_prompt)
        if episode.end is None and self.room(episode) <= 0:
            episode.end = EpisodeEnd(EndKind.LENGTH)
        return episode

    def room(self, e: Episode) -> int:
        """New tokens this turn may take: the turn's limit, within the episode's budget and the context."""
        lim = self.limits
        return min(lim.max_turn_tokens, lim.max_episode_tokens - len(e.token_ids),
                   lim.max_positions - len(e.prompt_ids) - len(e.token_ids))

    def take(self, episode: Episode, completion: Completion, version: int | None = None) -> str:
        """The model's turn into the episode (sampled by `version`, or by `completion.versions` per token);
        its text, the environment's action."""
        versions = completion.versions if version is None else version
        episode.append(completion.token_ids, completion.logprobs, versions, model=True)
        episode.turns += 1
        episode.turn_ends.append(len(episode.token_ids))
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def step_env(self, episode: Episode, action: str) -> StepResult | EnvFailure:
        """One environment step (on a pool thread: steps of many episodes run at once)."""
        assert episode.env is not None, "an ended episode takes no step"
        try:
            return base.step(episode.env, action, self.limits.step_timeout_s)
        except EnvFailure as err:
            return err

    def after_step(self, episode: Episode, finish: Finish, result: StepResult | EnvFailure) -> None:
        """The step's outcome into the episode, after the turn that ended with `finish`: its reward, and the
        end of the episode or the observation the next turn follows."""
        if isinstance(result, EnvFailure):
            episode.end, episode.finish = result.end, finish
            return
        episode.step_seconds.append(result.seconds)
        episode.reward += result.reward
        episode.turn_rewards.append(result.reward)
        for name, n in result.tool_calls.items():
            episode.tool_calls[name] = episode.tool_calls.get(name, 0) + n
        for name, n in result.tool_errors.items():
            episode.tool_errors[name] = episode.tool_errors.get(name, 0) + n
        if result.done:
            episode.end, episode.finish = EpisodeEnd(EndKind.DONE), "stop"
        elif episode.turns >= self.limits.max_turns:
            episode.end, episode.finish = EpisodeEnd(EndKind.MAX_TURNS), finish
        else:
            self._observe(episode, finish, result.messages)

    def _observe(self, episode: Episode, finish: Finish, messages: list[Message]) -> None:
        """The observation's ids after the turn (an EOS first when the turn was cut by length), with the
        version of the turn's last token."""
        closing = [] if finish == "stop" else [self.tokenizer.eos_token_id]
        try:
            ids = closing + self._ids(observation_text(self.tokenizer, messages, episode.tools))
        except ValueError as err:
            episode.end = EpisodeEnd(EndKind.MALFORMED, str(err))
            return
        used = len(episode.prompt_ids) + len(episode.token_ids) + len(ids)
        left = min(self.limits.max_episode_tokens - used + len(episode.prompt_ids),
                   self.limits.max_positions - used)
        if left <= 0:  # no room for a model turn after it: the observation is not appended
            episode.end, episode.finish = EpisodeEnd(EndKind.LENGTH), "length"
            return
        episode.append(ids, [0.0] * len(ids), episode.versions[-1], model=False)

    def _ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)


def opening_ids(tokenizer, first: list[Message], tools: Sequence[ToolSpec],
                system_prompt: str = "") -> list[int]:
    """An episode's first context as ids: the system prompt, the environment's first observation and the
    tools, rendered by the chat template and tokenised once (also what a warm start on tool calls trains
    after, `asyncrlhf.stages.sft`)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return text_ids(tokenizer, render_chat(tokenizer, system + first, tools))


def text_ids(tokenizer, text: str) -> list[int]:
    """`text` tokenised once, as written (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _cut(completion: Completion, limit: int) -> Completion:
    """The completion within this episode's own room (the batch sampled up to the largest room)."""
    if len(completion.token_ids) <= limit:
        return completion
    return Completion(completion.token_ids[:limit], completion.logprobs[:limit], "length")
