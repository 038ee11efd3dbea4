"""Token logprobs, as the workers report them, in OpenAI's two response shapes.

Chat: ``choices[].logprobs.content[]``, one ``{token, logprob, bytes, top_logprobs}``
per output token. Completions: the legacy parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (token text -> logprob) and ``text_offset``
(where each token's text starts in the choice's text). A token's text is the
tokenizer's decoding of that one token (as vLLM reports it), its ``bytes`` the raw
bytes it stands for (so a character split over tokens can be put back together). With
``return_tokens_as_token_ids`` (vLLM's extension) a token is named ``token_id:<id>``
instead: distinct tokens whose text is the same (pieces of one character all decode to
U+FFFD) stay distinct, so outputs can be compared token by token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.router.generation import TokenLogprobEntry
from pdd.router.openai_protocol import (
    TOKEN_ID_PREFIX,
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from pdd.router.tokenization import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _name(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else _text(tokenizer, token_id)


def _top(tokenizer: Tokenizer, token_id: int, logprob: float, as_ids: bool) -> ChatTopLogprob:
    raw = list(tokenizer.token_bytes(token_id))
    return ChatTopLogprob(token=_name(tokenizer, token_id, as_ids), logprob=logprob, bytes=raw)


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprobEntry], as_ids: bool = False
) -> ChatChoiceLogprobs:
    content = []
    for token_id, lp in entries:
        entry = _top(tokenizer, token_id, lp.logprob, as_ids)
        top = [_top(tokenizer, t.token_id, t.logprob, as_ids) for t in lp.top]
        content.append(ChatTokenLogprob(**entry.model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer,
    entries: Sequence[TokenLogprobEntry],
    text_offset: int,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The lists for ``entries``, the first token's text starting at ``text_offset``
    (offsets count the text, whichever way the tokens are named)."""
    out = CompletionLogprobs()
    for token_id, lp in entries:
        text = _text(tokenizer, token_id)
        out.tokens.append(_name(tokenizer, token_id, as_ids))
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_name(tokenizer, t.token_id, as_ids): t.logprob for t in lp.top})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out
