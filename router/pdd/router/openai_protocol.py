"""Pydantic schemas of the OpenAI wire format the router speaks to clients.

A request field we do not implement is refused (a 400 naming it, in the OpenAI API's
own words: "Unrecognized request argument supplied: X"), never taken and ignored: a
client that asked for something must not silently get something else. The few fields
real clients send that change nothing about the output (``user``, ``metadata``,
``store``, ``service_tier``) are declared and accepted; docs/router.md lists every
field with its status. Fields we implement are validated, so a bad value becomes a
400 with a message, not a 500: numbers and flags strictly (``max_tokens: true`` or
``"5"`` is refused, not read as 1 or 5, as the OpenAI API refuses them), stop strings
non-empty, a message's content text or text parts (an image or audio part is refused:
the models served here read text only). Messages and tool definitions keep extra keys: they are
the chat template's input (``tool_calls``, ``tool_call_id`` ...). Every error,
including one in the middle of a stream, has the one ``ErrorResponse`` shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from pdd.common.vocabulary import FinishReason
from pdd.common.wire import REPETITION_PENALTY_RANGE


class _Request(BaseModel):
    """A nested request object whose extra keys are passed on (to the chat template)."""

    model_config = ConfigDict(extra="allow")


class _StrictRequest(BaseModel):
    """A request body: a key that is not a declared field is refused (see the docstring)."""

    model_config = ConfigDict(extra="forbid")


#: The pydantic error type of an undeclared key in a ``_StrictRequest``.
UNRECOGNIZED_FIELD_ERROR = "extra_forbidden"


def unrecognized_argument(field: str) -> str:
    """The message for a field we do not implement, worded as the OpenAI API words it."""
    return f"Unrecognized request argument supplied: {field}"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SparseWire(_Wire):
    """A streamed delta: unset (None) fields are left out, as OpenAI leaves them out. The
    SDK's accumulator copies every key it gets, so a ``"type": null`` in a later chunk
    of a tool call would overwrite the ``"function"`` of its first."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class StreamOptions(_Wire):
    include_usage: StrictBool = False


#: How logprobs name a token with ``return_tokens_as_token_ids``: ``token_id:<id>`` (vLLM's).
TOKEN_ID_PREFIX = "token_id:"


class SamplingFields(_StrictRequest):
    """Sampling fields shared by both endpoints (``top_k``, ``ignore_eos``,
    ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and
    ``return_tokens_as_token_ids`` are vLLM's extensions).

    ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and change
    nothing: an end-user tag, a stored-completion tag, a request to store the
    completion (nothing is stored here) and OpenAI's processing tier."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    #: Each sample is a routed request of its own; 16 bounds what one call can ask of the
    #: fleet (OpenAI takes up to 128).
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(
        default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    min_tokens: StrictInt = Field(default=0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    #: Token id (as a string, JSON keys are strings) -> bias in [-100, 100].
    logit_bias: dict[str, StrictFloat] | None = None
    #: Logprobs name each token ``TOKEN_ID_PREFIX`` + its id rather than by its text.
    return_tokens_as_token_ids: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """An empty stop string matches before any output: nothing could be generated."""
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("a stop string must not be empty")
        return stop

    @model_validator(mode="after")
    def _valid_logit_bias(self) -> SamplingFields:
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {key}")
        return self

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as the workers take it: (token id, bias) pairs."""
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per position to report (0: only the token's), None: no logprobs."""
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FunctionDefinition(_Request):
    """A function the model may call; ``parameters`` is its arguments' JSON Schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


#: Content parts that carry text, and the key that holds it: ``text`` in any message,
#: ``refusal`` in an assistant's (OpenAI's shape of an earlier refusal).
TEXT_PARTS = {"text": "text", "refusal": "refusal"}
#: Content parts of other media, and what to call them when one is refused.
MEDIA_PARTS = {
    "image_url": "images are",
    "input_image": "images are",
    "input_audio": "audio is",
    "audio_url": "audio is",
    "video_url": "video is",
    "file": "files are",
    "input_file": "files are",
}


class ChatMessage(_Request):
    """One message; extra keys (``tool_calls``, ``tool_call_id`` ...) pass to the template.
    ``content`` is a text, or a list of content parts of which only text parts are
    taken (a model here reads text only: an image part is a 400 saying so)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(
        cls, content: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if not isinstance(kind, str):
                raise ValueError(f"a content part needs 'type': a string, not {kind!r}"[:200])
            if kind in MEDIA_PARTS:
                raise ValueError(
                    f"{MEDIA_PARTS[kind]} not supported: this model takes text only "
                    f"(a {kind!r} content part)"
                )
            if kind not in TEXT_PARTS:
                raise ValueError(
                    f"content part type {kind!r} is not supported; "
                    f"parts may be {sorted(TEXT_PARTS)}"
                )
            if not isinstance(part.get(TEXT_PARTS[kind]), str):
                raise ValueError(f"a {kind!r} content part needs {TEXT_PARTS[kind]!r}: a string")
        return content

    def text(self) -> str | None:
        """The message's text as chat templates take it: the content, or its text parts
        joined by newlines (as vLLM joins them for a template that reads a string)."""
        if not isinstance(self.content, list):
            return self.content
        return "\n".join(part[TEXT_PARTS[part["type"]]] for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = {t.function.name for t in self.tools or []}
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs at least one tool in tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (plain JSON), or None without tools."""
        if not self.tools:
            return None
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]

    @property
    def output_token_limit(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """A plain completion; ``prompt`` is text or already-tokenized IDs (one prompt)."""

    prompt: str | list[StrictInt]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)

    @model_validator(mode="after")
    def _non_empty_prompt(self) -> CompletionRequest:
        if len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs with echo (the prompt's logprobs) is not supported")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def output_token_limit(self) -> int | None:
        return self.max_tokens


class PromptTokensDetails(_Wire):
    cached_tokens: int = 0


class UsageInfo(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class FunctionCall(_Wire):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(_Wire):
    """A call the model made (``message.tool_calls``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatTopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatChoiceLogprobs(_Wire):
    """A chat choice's (or chunk's) ``logprobs``: one entry per output token."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Wire):
    """A completion choice's ``logprobs``, the legacy parallel-lists shape."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class ChatResponseMessage(_Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Wire):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(_Wire):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(_SparseWire):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SparseWire):
    """A piece of a streamed call: the first of a call has ``id``, ``type`` and the name;
    the later ones carry ``index`` and a piece of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_SparseWire):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(_Wire):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(_Wire):
    """One streamed chat frame; the final usage-only frame has ``choices == []``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Wire):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Wire):
    """A completion, and (with ``usage`` unset until the end) each streamed frame of one."""

    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ErrorDetail(_Wire):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Wire):
    """The one error shape, as a response body and as an SSE frame mid-stream."""

    error: ErrorDetail

    @classmethod
    def of(
        cls, message: str, type: str, code: int | str | None = None, param: str | None = None
    ) -> ErrorResponse:
        return cls(error=ErrorDetail(message=message, type=type, param=param, code=code))


#: The terminator of every OpenAI event stream.
SSE_DONE = b"data: [DONE]\n\n"


def sse_frame(payload: BaseModel) -> bytes:
    """One server-sent event; the blank line (two newlines) ends the event."""
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


class ModelCard(_Wire):
    """One served model in ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "pdd"


class ModelList(_Wire):
    """``GET /v1/models``: the model this router serves."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
