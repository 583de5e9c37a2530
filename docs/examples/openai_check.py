"""Check a running generator with the official `openai` client: every part of the OpenAI API it serves.

    python docs/examples/openai_check.py http://127.0.0.1:PORT [TOKEN]

PORT is the generator's HTTP port (`asyncrlhf up` logs it: "HTTP on http://..." in logs/generator-0.log);
TOKEN is `run.token` when one is set. Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import openai


def main(url: str, token: str = "none") -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)

    (model,) = client.models.list().data
    print(f"models: {model.id} at policy version {model.policy_version}")

    def greedy(**kw):
        return client.completions.create(model=model.id, prompt="hello", temperature=0, max_tokens=16, **kw)

    reply = client.completions.create(model=model.id, prompt=["hello", "bye"], n=2, max_tokens=8, user="me")
    assert len(reply.choices) == 4 and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + reply.usage.completion_tokens)
    print(f"completions: 4 choices, usage {reply.usage.model_dump()}")

    chat = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=8)
    print(f"chat: {chat.choices[0].message.content!r} ({chat.choices[0].finish_reason})")

    chunks = list(client.completions.create(model=model.id, prompt="hello", temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = greedy()
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    if plain.policy_version == chunks[0].policy_version:  # a training run may push between the two
        assert streamed == plain.choices[0].text
    print(f"stream: {len(chunks)} chunks, same text as without stream, usage last")

    texts = {c.text for c in greedy(n=3).choices}
    assert len(texts) == 1
    print("greedy: temperature 0 is deterministic")

    def seeded(seed):
        return client.completions.create(model=model.id, prompt="hello", max_tokens=16, seed=seed)

    first, again = seeded(3), seeded(3)
    if first.policy_version == again.policy_version:
        assert first.choices[0].text == again.choices[0].text
    sample = again.choices[0].text
    stop = sample[4:6]
    cut = client.completions.create(model=model.id, prompt="hello", max_tokens=16, seed=3, stop=stop)
    if cut.policy_version == again.policy_version:
        assert cut.choices[0].text == sample[: sample.find(stop)] and cut.choices[0].finish_reason == "stop"
    print(f"stop + seed: {sample!r} with stop {stop!r} -> {cut.choices[0].text!r}")

    ids = client.completions.create(model=model.id, prompt=[1, 50, 60, 70], max_tokens=4, logprobs=3)
    top = ids.choices[0].logprobs.top_logprobs
    assert len(top) == ids.usage.completion_tokens and all(1 <= len(t) <= 3 for t in top)
    print(f"token-id prompt with logprobs=3: {ids.usage.completion_tokens} tokens, top alternatives each")

    for bad, error in [({"best_of": 3}, openai.BadRequestError), ({"model": "nope"}, openai.NotFoundError)]:
        try:
            client.completions.create(**{"model": model.id, "prompt": "hi", **bad})
        except error as err:
            print(f"{err.status_code}: {err.message}")
        else:
            raise AssertionError(f"{bad} was accepted")
    print("all checks passed")


if __name__ == "__main__":
    main(*sys.argv[1:])
