"""OpenAI's request and response bodies for the subset we serve (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`), as pydantic models. Unknown request fields are refused (the API answers 400 naming
them) rather than silently ignored; the responses add `policy_version` and `generator_id`, which OpenAI
clients keep as extra fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PROMPTS = 64
MAX_TOP_LOGPROBS = 20

Prompt = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices).")


class SamplingRequest(BaseModel):
    """The parameters completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model's id (GET /v1/models); another answers 404.")
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    temperature: float = Field(1.0, ge=0, le=100,
                               description="0: greedy (deterministic). Log-probs are the model's own "
                                           "distribution's, whatever the temperature and top_p.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    seed: int | None = Field(None, description="Same seed, same request, same weights: same completions.")
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings; the text ends before the first one (not included).")
    stream: bool = Field(False, description="Server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted (an end-user id for the caller's records).")
    presence_penalty: float = Field(0.0, description="Only 0 (no penalty) is served.")
    frequency_penalty: float = Field(0.0, description="Only 0 (no penalty) is served.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give at most 4 non-empty stop strings")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported: leave it out or send 0")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(description="Text, texts, token ids, or lists of token ids (raw: no chat "
                                       "template; use /v1/chat/completions for that).")
    max_tokens: int = Field(16, ge=1, le=4096, description="Most completion tokens per choice.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="Log-prob of each token and of the N most likely at each step.")
    echo: bool = Field(False, description="Prefix each choice with its prompt (and its log-probs).")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Prompt) -> Prompt:
        items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not items or len(items) > MAX_PROMPTS:  # type: ignore[arg-type]
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts")
        if any(len(p) == 0 for p in items):  # type: ignore[arg-type]
            raise ValueError("prompts must not be empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object, in a string (as OpenAI sends them).")


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="Required but for an assistant message that calls tools.")
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("`content` is required (only an assistant message with tool_calls may omit it)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the `tool_call_id` it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}},
                             description="The arguments as a JSON schema.")
    strict: bool | None = Field(None, description="Accepted; arguments are not checked against the schema.")


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation; the chat template of "
                                                                  "the policy's tokenizer renders it.")
    max_tokens: int | None = Field(None, ge=1, le=4096,
                                   description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=4096, description="Most tokens per choice (16).")
    logprobs: bool = Field(False, description="Log-prob of each completion token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="With logprobs: the N most likely tokens at each step.")
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call; the chat template "
                                                           "renders them (asyncrlhf.chat_format).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: calls are not parsed; auto (the default with tools): parsed when the model "
                          "writes them; required / a named function: the call's opening is written for the "
                          "model, which writes the rest.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; every call the model writes is "
                                                               "returned.")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and self.tool_choice.function.name \
                not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not in tools")
        return self

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Every prompt counted once, however many choices.")
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="None for the first prompt token (echo).")
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]
    token_ids: list[int] = Field(description="Not in OpenAI's: the token ids of `tokens`.")


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt_index * n + sample_index")
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Identity(BaseModel):
    id: str
    created: int
    model: str
    policy_version: int = Field(description="Version of the weights that sampled every choice.")
    generator_id: str


class CompletionResponse(Identity):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] | None = None


ChatFinish = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinish
    logprobs: ChatLogprobs | None = None


class ChatResponse(Identity):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCallItem):
    index: int


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: ChatFinish | None = None
    logprobs: ChatLogprobs | None = None


class ChatChunk(Identity):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asyncrlhf"
    policy_version: int = Field(description="The weights version the generator serves now (0: none yet).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
