"""``POST /v1/completions``: a text (or token-ID) prompt, routed and relayed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pdd.common.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
)
from pdd.common.vocabulary import FinishReason
from pdd.router.errors import InvalidRequestError
from pdd.router.generation import Generation, TokenLogprobEntry
from pdd.router.logprobs import completion_logprobs
from pdd.router.serving_base import OpenAIServing, Served
from pdd.router.tokenization import TokenIdError


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> Served:
        self.check(request)
        try:
            prompt_ids = self.runtime.tokenizer.completion_ids(request.prompt)
        except TokenIdError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from exc
        generation = await self.start(prompt_ids, request, request.output_token_limit, "prompt")
        echo = self._echo(request)
        if request.stream:
            return Served(generation, self.sse(self._chunks(request, generation, echo)))
        text = echo + await self.collect(generation)
        response = CompletionResponse(
            model=request.model,
            choices=[
                CompletionChoice(
                    text=text,
                    finish_reason=generation.finish_reason,
                    logprobs=self._logprobs(request, generation.logprobs, 0),
                )
            ],
            usage=generation.usage(),
        )
        return Served(generation, response)

    def _logprobs(
        self, request: CompletionRequest, entries: Sequence[TokenLogprobEntry], offset: int
    ) -> CompletionLogprobs | None:
        if request.logprobs_count is None:
            return None
        return completion_logprobs(self.runtime.tokenizer.tokenizer, entries, offset)

    def _echo(self, request: CompletionRequest) -> str:
        if not request.echo:
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        return self.runtime.tokenizer.tokenizer.decode(request.prompt)

    async def _chunks(
        self, request: CompletionRequest, generation: Generation, echo: str
    ) -> AsyncIterator[CompletionResponse]:
        rid = new_id("cmpl")

        def frame(
            text: str,
            finish: FinishReason | None = None,
            logprobs: CompletionLogprobs | None = None,
        ) -> CompletionResponse:
            choice = CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)
            return CompletionResponse(id=rid, model=request.model, choices=[choice])

        if echo:
            yield frame(echo)
        offset = 0  # where the next token's text starts in the output
        async for delta in generation.deltas():
            if delta.text or delta.finish_reason:
                logprobs = self._logprobs(request, delta.logprobs, offset)
                if logprobs is not None:
                    offset += sum(len(t) for t in logprobs.tokens)
                yield frame(delta.text, delta.finish_reason, logprobs)
        if request.include_usage_in_stream:
            yield CompletionResponse(
                id=rid, model=request.model, choices=[], usage=generation.usage()
            )
