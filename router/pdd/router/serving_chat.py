"""``POST /v1/chat/completions``: template, tokenize, route, relay, answer.

With ``tools`` (and ``tool_choice`` other than ``none``) each choice's output is read
for tool calls in the model's format (``runtime.tool_call_format``): the calls become
``message.tool_calls`` (streaming: ``delta.tool_calls``) and the finish reason
``tool_calls``; ``parallel_tool_calls: false`` keeps the first call only.
``tool_choice: none`` still renders the tools, as OpenAI does, but the output is plain
text.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pdd.common.vocabulary import FinishReason, ToolCallFormat
from pdd.router.chat_template import ChatTemplateError, ReservedKwargError
from pdd.router.errors import InvalidRequestError
from pdd.router.generation import TokenLogprobEntry
from pdd.router.logprobs import chat_logprobs
from pdd.router.openai_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    new_id,
)
from pdd.router.samples import Samples
from pdd.router.serving_base import Choice, OpenAIServing, Served
from pdd.router.structured_output import guided_decoding
from pdd.router.tool_call_stream import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    StreamEvent,
    ToolCallStream,
    tool_call_stream,
)
from pdd.router.tool_calls import parse_tool_calls


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest) -> Served:
        self.check(request)
        tool_format = self._tool_format(request)
        prompt_ids = self._prompt_ids(request)
        guided = guided_decoding(request, tool_format)
        samples = await self.start_samples(
            prompt_ids, request, request.output_token_limit, "messages", guided
        )
        if request.stream:
            frames = self._chunks(request, samples, tool_format)
            return Served(samples.first, self.sse(frames))
        choices = [
            self._choice(i, c, tool_format, request.parallel_tool_calls).model_copy(
                update={"logprobs": self._logprobs(request, c.logprobs)}
            )
            for i, c in enumerate(await self.collect_samples(samples))
        ]
        response = ChatCompletionResponse(
            model=request.model, choices=choices, usage=samples.usage()
        )
        return Served(samples.first, response)

    def _tool_format(self, request: ChatCompletionRequest) -> ToolCallFormat | None:
        """The format to read tool calls in; None: the output is not read for calls."""
        if not request.tools or request.tool_choice == "none":
            return None
        fmt = self.runtime.tool_call_format
        if fmt is None:
            raise InvalidRequestError(
                "this model's chat template shows no tool-call format, so its calls cannot "
                "be read: start the router with --tool-call-format",
                param="tools",
            )
        return fmt

    def _logprobs(
        self, request: ChatCompletionRequest, entries: Sequence[TokenLogprobEntry]
    ) -> ChatChoiceLogprobs | None:
        if request.logprobs_count is None:
            return None
        return chat_logprobs(
            self.runtime.tokenizer.tokenizer, entries, request.return_tokens_as_token_ids
        )

    @staticmethod
    def _choice(
        index: int, choice: Choice, fmt: ToolCallFormat | None, parallel: bool
    ) -> ChatCompletionChoice:
        if fmt is None:
            message = ChatResponseMessage(content=choice.text)
            return ChatCompletionChoice(
                index=index, message=message, finish_reason=choice.finish_reason
            )
        parsed = parse_tool_calls(fmt, choice.text)
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls[: None if parallel else 1]
        ]
        message = ChatResponseMessage(content=parsed.content, tool_calls=calls or None)
        finish = _finish_reason(choice.finish_reason, bool(calls))
        return ChatCompletionChoice(index=index, message=message, finish_reason=finish)

    def _prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        messages = [_template_message(m) for m in request.messages]
        try:
            return self.runtime.tokenizer.chat_ids(
                messages,
                request.add_generation_prompt,
                request.tool_dicts,
                request.chat_template_kwargs,
            )
        except ReservedKwargError as exc:
            param = f"chat_template_kwargs.{exc.key}"
            raise InvalidRequestError(str(exc), param=param) from exc
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc

    async def _chunks(
        self, request: ChatCompletionRequest, samples: Samples, fmt: ToolCallFormat | None
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        rid = new_id("chatcmpl")

        def chunk(
            index: int,
            delta: DeltaMessage,
            finish: FinishReason | None = None,
            entries: Sequence[TokenLogprobEntry] = (),
        ) -> ChatCompletionChunk:
            logprobs = self._logprobs(request, entries) if entries else None
            choice = ChatCompletionChunkChoice(
                index=index, delta=delta, finish_reason=finish, logprobs=logprobs
            )
            return ChatCompletionChunk(id=rid, model=request.model, choices=[choice])

        streams: list[ToolCallStream | None] = [
            tool_call_stream(fmt) if fmt else None for _ in range(samples.n)
        ]
        # Logprobs of tokens whose text a tool-call stream still holds back, per choice:
        # they ride on the next chunk that choice sends.
        held: list[list[TokenLogprobEntry]] = [[] for _ in range(samples.n)]
        for index in range(samples.n):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        async with contextlib.aclosing(samples.deltas()) as deltas:
            async for index, delta in deltas:
                stream = streams[index]
                if stream is None:
                    if delta.text or delta.finish_reason:
                        content = DeltaMessage(content=delta.text or None)
                        yield chunk(index, content, delta.finish_reason, delta.logprobs)
                    continue
                held[index] += delta.logprobs
                events = stream.feed(delta.text)
                if delta.finish_reason:
                    events += stream.finish()
                for event in events:
                    if request.parallel_tool_calls or not _later_call(event):
                        yield chunk(index, _delta_of(event), entries=held[index])
                        held[index] = []
                if delta.finish_reason:
                    finish = _finish_reason(delta.finish_reason, stream.calls > 0)
                    yield chunk(index, DeltaMessage(), finish, held[index])
        if request.include_usage_in_stream:
            yield ChatCompletionChunk(
                id=rid, model=request.model, choices=[], usage=samples.usage()
            )


def _finish_reason(reason: FinishReason | None, called: bool) -> FinishReason | None:
    """``tool_calls`` when the model called a tool and stopped by itself (a call cut by
    ``max_tokens`` stays ``length``: the client must know it is incomplete)."""
    return "tool_calls" if called and reason == "stop" else reason


def _later_call(event: StreamEvent) -> bool:
    """A part of a call after the first (left out under ``parallel_tool_calls: false``)."""
    return isinstance(event, CallStart | ArgumentsDelta) and event.index > 0


def _delta_of(event: StreamEvent) -> DeltaMessage:
    if isinstance(event, ContentDelta):
        return DeltaMessage(content=event.text)
    if isinstance(event, CallStart):
        function = DeltaFunctionCall(name=event.name, arguments="")
        call = DeltaToolCall(index=event.index, id=event.id, type="function", function=function)
        return DeltaMessage(tool_calls=[call])
    assert isinstance(event, ArgumentsDelta)
    function = DeltaFunctionCall(arguments=event.text)
    return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=function)])


def _template_message(chat_message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: content parts joined into one text
    (``ChatMessage.text``: templates concatenate ``message['content']`` as a string), and
    the arguments of an assistant's earlier tool calls, a JSON *text* on the wire but an
    object in templates (they ``tojson`` it), decoded first, as vLLM does; a text that is
    not JSON stays as it is."""
    message = chat_message.model_dump(exclude_none=True)
    if isinstance(chat_message.content, list):
        message["content"] = chat_message.text()
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    decoded = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}
