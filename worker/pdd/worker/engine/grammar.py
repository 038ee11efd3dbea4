"""Structured output in the engine: a per-request grammar matcher and its token mask.

A request with ``SamplingParams.guided`` gets a :class:`GrammarState` at admission. Before
each pick the matcher is advanced over every output token it has not seen yet: the
tokens this engine sampled, and the ones another instance generated and handed over
(the prefill's token 0, a relay's tokens before a handoff), so a main decode that takes
a request over mid-object continues the same grammar as the instance it came from.
Then the mask sets every token the grammar forbids to ``-inf`` (EOS is allowed only
where the grammar accepts); once the grammar can go no further the request finishes
with ``stop``.

Grammars come from ``pdd.common.grammar`` (the router checks the same text) and are
compiled once per spec: a fresh matcher is kept per spec and each request gets a copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from pdd.common.grammar import GrammarError, check_grammar, parser_limits
from pdd.common.grammar_probe import byte_tokenizer
from pdd.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdd.common.wire import GuidedDecoding
from pdd.worker.engine.request import OutputGrammar, RequestError

#: Compiled grammars kept per engine (agents reuse a handful of schemas and tool sets).
CACHE_SIZE = 64


class GrammarRequestError(RequestError):
    """A structured-output request this engine cannot serve (bad schema, no tokenizer)."""


class GrammarStateError(RuntimeError):
    """An output token the grammar does not allow: a handed-over token no instance
    with the same grammar could have sampled (a bug or a mismatched pipeline)."""


class GrammarFailedError(RuntimeError):
    """llguidance gave up on a request's grammar (one of its work limits, see
    ``parser_limits``): the grammar's own failure, which admission's probe of its first
    tokens did not reach."""


def _llg_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer(tokenizer)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), eos_token=list(tokenizer.eos_token_ids))
    raise GrammarRequestError(
        "structured output needs the model's tokenizer.json (the grammar is over its "
        "vocabulary); this instance has none"
    )


class GrammarCompiler:
    """Compiles specs into matchers over one model's vocabulary, caching by spec.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's:
    the ids past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._llg: llguidance.LLTokenizer | None = None  # built at the first guided request
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def num_compiled(self) -> int:
        """Grammars compiled and kept (one per distinct spec, at most ``CACHE_SIZE``)."""
        return len(self._cache)

    def start(self, spec: GuidedDecoding, prior_output: Sequence[int] = ()) -> GrammarState:
        """A matcher at the start of ``spec``'s output, after ``prior_output`` (a resumed
        request's output from its earlier attempt, carried in its prompt);
        ``GrammarRequestError`` if it cannot compile or the prior output breaks it."""
        key = spec.model_dump_json()
        matcher = self._cache.get(key)
        if matcher is None:
            matcher = self._compile(spec)
            self._cache[key] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        state = GrammarState(matcher.deep_copy(), self.vocab_size)
        try:
            state.advance(prior_output)
        except GrammarStateError as e:
            raise GrammarRequestError(
                f"the output sent so far does not fit the grammar: {e}"
            ) from None
        state.consumed = 0  # the prior output is in the prompt, not in output_ids
        return state

    def _compile(self, spec: GuidedDecoding) -> llguidance.LLMatcher:
        if self._llg is None:
            self._llg = _llg_tokenizer(self._tokenizer)
        try:
            grammar = check_grammar(spec)
        except GrammarError as e:
            raise GrammarRequestError(str(e)) from None
        matcher = llguidance.LLMatcher(self._llg, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarRequestError(
                f"the structured-output grammar cannot be compiled: {_error(matcher)}"
            )
        return matcher


class GrammarState:
    """One request's matcher and how many of its output tokens the matcher has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self.consumed = 0

    def advance(self, output_ids: Sequence[int]) -> None:
        """Consume the output tokens not consumed yet (sampled here or handed over)."""
        for token in output_ids[self.consumed :]:
            if self._matcher.is_stopped():
                return  # a finished grammar takes nothing more; the request stops
            if not self._matcher.consume_token(token):
                raise GrammarStateError(
                    f"output token {token} at position {self.consumed} breaks the grammar: "
                    f"{_error(self._matcher)}"
                )
            self.consumed += 1

    @property
    def complete(self) -> bool:
        """The grammar can take no more text: the output is whole and must stop here (a
        matcher in error has stopped too, but its output is not whole)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def allowed(self) -> torch.Tensor:
        """A bool ``[vocab]`` tensor: True where the grammar allows the next token;
        ``GrammarFailedError`` where llguidance gave up computing it (its mask would then
        allow only EOS, and the request would end as if its output were whole)."""
        # Bit i of the (little-endian) bitmask is token i: one C pass unpacks it.
        bitmask = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            raise GrammarFailedError(_error(self._matcher))
        packed = np.frombuffer(bitmask, dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: self._vocab_size]
        allowed = torch.zeros(self._vocab_size, dtype=torch.bool)
        allowed[: bits.size] = torch.from_numpy(bits.astype(bool))
        return allowed


def _error(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, first line only (the rest is its parser state)."""
    return next(iter(matcher.get_error().strip().splitlines()), "no reason given")


def mask_logits(logits: torch.Tensor, states: Sequence[OutputGrammar | None]) -> torch.Tensor:
    """``logits`` ``[N, vocab]`` with each guided row's forbidden tokens set to ``-inf``
    (unguided rows untouched); the sampler then picks among the allowed ones only."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    allowed = torch.stack([states[i].allowed() for i in rows]).to(logits.device)  # type: ignore[union-attr]
    masked = logits.clone()
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked
