"""OpenRLHF's remote reward-model queries, read back into the items the pipeline scores.

OpenRLHF sends `query`: the whole sequence decoded *with* special tokens, i.e. the chat-templated prompt,
the completion, its end-of-turn / EOS marker and any padding (`<s>user\\nHi</s>\\n<s>assistant\\nHello</s>
<pad>`), and newer clients add the templated `prompts`. The pipeline scores `Item(prompt, completion)` with
the dataset prompt as written (no template) and the completion decoded *without* special tokens. So that
both score the same, `QueryReader` undoes the template with the policy tokenizer's own rendering (the one
`asyncrlhf.models.encode_prompts` uses, system prompt included) and decodes the completion again without
special tokens. A query that does not follow the template is scored as it is (prompt "", completion all).
"""

from __future__ import annotations

from asyncrlhf.config import ModelConfig
from asyncrlhf.rewards.base import Item

_SENTINEL = "\x00asyncrlhf-prompt\x00"


class QueryReader:
    def __init__(self, tokenizer, model: ModelConfig):
        self.tokenizer = tokenizer
        self.head, self.tail = "", ""
        if model.apply_chat_template and tokenizer.chat_template:
            messages = [{"role": "user", "content": _SENTINEL}]
            if model.system_prompt:
                messages.insert(0, {"role": "system", "content": model.system_prompt})
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self.head, _, self.tail = rendered.partition(_SENTINEL)

    @classmethod
    def from_config(cls, model: ModelConfig) -> QueryReader:
        from asyncrlhf.models import load_tokenizer

        return cls(load_tokenizer(model), model)

    def item(self, query: str, prompt: str | None = None, label: str | None = None) -> Item:
        """The pipeline's item for one query (and its templated prompt, when the client sent it)."""
        if prompt and query.startswith(prompt):
            raw_prompt, completion = self.untemplate(prompt), query[len(prompt):]
        else:
            raw_prompt, completion = self.split(query)
        return Item(raw_prompt, self.clean(completion), True, None, label)

    def split(self, query: str) -> tuple[str, str]:
        """(raw prompt, completion) of a templated query; ("", query) when it does not follow the template."""
        if self.tail:
            start = query.find(self.head)
            end = query.find(self.tail, start + len(self.head)) if start >= 0 else -1
            if start >= 0 and end >= 0 and not self.clean(query[:start]):  # only BOS / padding before it
                return query[start + len(self.head):end], query[end + len(self.tail):]
        return "", query

    def untemplate(self, prompt: str) -> str:
        raw, rest = self.split(prompt)
        return raw if self.tail and not self.clean(rest) and raw else prompt

    def clean(self, text: str) -> str:
        """The text as the generator decodes completions: special tokens (EOS, end-of-turn, padding) out."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
