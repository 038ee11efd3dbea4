"""``POST /v1/chat/completions``: template, tokenize, route, relay, answer."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.common.openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    new_id,
)
from pdd.common.vocabulary import FinishReason
from pdd.router.chat_template import ChatTemplateError
from pdd.router.errors import InvalidRequestError
from pdd.router.generation import Generation
from pdd.router.serving_base import OpenAIServing, Served
from pdd.router.structured_output import guided_decoding


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest) -> Served:
        self.check(request)
        prompt_ids = self._prompt_ids(request)
        guided = guided_decoding(request, self.runtime.config.tool_call_format)
        generation = await self.start(
            prompt_ids, request, request.output_token_limit, "messages", guided
        )
        if request.stream:
            frames = self._chunks(request, generation)
            return Served(generation, self.sse(frames))
        text = await self.collect(generation)
        response = ChatCompletionResponse(
            model=request.model,
            choices=[
                ChatCompletionChoice(
                    message=ChatResponseMessage(content=text),
                    finish_reason=generation.finish_reason,
                )
            ],
            usage=generation.usage(),
        )
        return Served(generation, response)

    def _prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        try:
            return self.runtime.tokenizer.chat_ids(
                messages,
                request.add_generation_prompt,
                request.tool_dicts,
                **(request.chat_template_kwargs or {}),
            )
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc

    async def _chunks(
        self, request: ChatCompletionRequest, generation: Generation
    ) -> AsyncIterator[ChatCompletionChunk]:
        rid = new_id("chatcmpl")

        def chunk(delta: DeltaMessage, finish: FinishReason | None = None) -> ChatCompletionChunk:
            choice = ChatCompletionChunkChoice(delta=delta, finish_reason=finish)
            return ChatCompletionChunk(id=rid, model=request.model, choices=[choice])

        yield chunk(DeltaMessage(role="assistant", content=""))
        async for delta in generation.deltas():
            if delta.text or delta.finish_reason:
                yield chunk(DeltaMessage(content=delta.text or None), delta.finish_reason)
        if request.include_usage_in_stream:
            yield ChatCompletionChunk(
                id=rid, model=request.model, choices=[], usage=generation.usage()
            )
