"""A verifiers environment for the adapter's tests, loaded by `verifiers.load_environment` by this module's
name: each environment response is "obs <turn>" (a user message) until its `max_turns`; the rubric gives 1
when the last model turn holds the reference answer. A prompt holding a behaviour's word makes its episode
fail that way at the first environment response: "boom" raises, "hang" never answers, "junk" answers a
message whose content is not text, "rewrite" rewrites the conversation, "stop" raises an error verifiers
stops the rollout on."""

from __future__ import annotations

import asyncio

import verifiers as vf
from datasets import Dataset


def holds_answer(completion, answer) -> float:
    said = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return float(bool(answer) and bool(said) and answer in said[-1])


class Scripted(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        prompt = state["prompt"][-1]["content"]
        if "boom" in prompt:
            raise RuntimeError("the sandbox died")
        if "hang" in prompt:
            await asyncio.sleep(3600)
        if "junk" in prompt:
            return [{"role": "user", "content": 42}]
        if "stop" in prompt:
            raise vf.ToolCallError("the tool server is gone")
        return [{"role": "user", "content": f"obs {len(state['trajectory'])}"}]

    async def get_prompt_messages(self, state):
        messages = await super().get_prompt_messages(state)
        if state["trajectory"] and "rewrite" in state["prompt"][-1]["content"]:
            return messages[1:]
        return messages


def load_environment(max_turns: int = 3, system_prompt: str | None = None) -> vf.Environment:
    dataset = Dataset.from_dict({"question": ["What is 1 + 1?"], "answer": ["2"]})
    return Scripted(max_turns=max_turns, dataset=dataset, system_prompt=system_prompt,
                    rubric=vf.Rubric(funcs=[holds_answer]))
