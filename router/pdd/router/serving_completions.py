"""``POST /v1/completions``: a text (or token-ID) prompt, routed and relayed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

from pdd.common.vocabulary import FinishReason
from pdd.router.errors import InvalidRequestError
from pdd.router.generation import TokenLogprobEntry
from pdd.router.logprobs import completion_logprobs
from pdd.router.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
)
from pdd.router.samples import Samples
from pdd.router.serving_base import OpenAIServing, Served
from pdd.router.tokenization import TokenIdError


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> Served:
        self.check(request)
        try:
            prompt_ids = self.runtime.tokenizer.completion_ids(request.prompt)
        except TokenIdError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from exc
        samples = await self.start_samples(
            prompt_ids, request, request.output_token_limit, "prompt"
        )
        echo = self._echo(request)
        if request.stream:
            return Served(samples.first, self.sse(self._chunks(request, samples, echo)))
        choices = [
            CompletionChoice(
                index=i,
                text=echo + c.text,
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(request, c.logprobs, 0),
            )
            for i, c in enumerate(await self.collect_samples(samples))
        ]
        response = CompletionResponse(model=request.model, choices=choices, usage=samples.usage())
        return Served(samples.first, response)

    def _logprobs(
        self, request: CompletionRequest, entries: Sequence[TokenLogprobEntry], offset: int
    ) -> CompletionLogprobs | None:
        if request.logprobs_count is None:
            return None
        return completion_logprobs(
            self.runtime.tokenizer.tokenizer, entries, offset, request.return_tokens_as_token_ids
        )

    def _echo(self, request: CompletionRequest) -> str:
        if not request.echo:
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        return self.runtime.tokenizer.tokenizer.decode(request.prompt)

    async def _chunks(
        self, request: CompletionRequest, samples: Samples, echo: str
    ) -> AsyncGenerator[CompletionResponse, None]:
        rid = new_id("cmpl")

        def frame(
            index: int,
            text: str,
            finish: FinishReason | None = None,
            logprobs: CompletionLogprobs | None = None,
        ) -> CompletionResponse:
            choice = CompletionChoice(
                index=index, text=text, finish_reason=finish, logprobs=logprobs
            )
            return CompletionResponse(id=rid, model=request.model, choices=[choice])

        if echo:
            for index in range(samples.n):
                yield frame(index, echo)
        offsets = [0] * samples.n  # where each choice's next token text starts in its output
        async with contextlib.aclosing(samples.deltas()) as deltas:
            async for index, delta in deltas:
                if delta.text or delta.finish_reason:
                    logprobs = self._logprobs(request, delta.logprobs, offsets[index])
                    if logprobs is not None:
                        offsets[index] += sum(len(t) for t in logprobs.tokens)
                    yield frame(index, delta.text, delta.finish_reason, logprobs)
        if request.include_usage_in_stream:
            yield CompletionResponse(id=rid, model=request.model, choices=[], usage=samples.usage())
