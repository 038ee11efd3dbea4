"""Token IDs -> text deltas for streaming, and OpenAI ``stop`` strings.

Decoding one token at a time breaks multi-byte characters and byte-level BPE
merges, so (as vLLM does) each step decodes a short window of recent tokens twice,
with and without the new one, and emits only the difference; a trailing U+FFFD means
the character is not complete yet and the text is held back (until ``finish``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.router.tokenization import Tokenizer

#: Tokens of left context kept for the window; enough for any merge to settle.
_CONTEXT_TOKENS = 6


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # window start
    _read: int = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often '', never a broken char)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix = max(self._prefix, len(self.ids) - _CONTEXT_TOKENS)
        self._read = len(self.ids)
        return after[len(before) :]

    def finish(self) -> str:
        """The text still held back when the output ends: a character that never
        completed comes out as U+FFFD, so the whole equals ``decode(ids)`` (as vLLM's)."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        self._read = len(self.ids)
        return after[len(before) :]


@dataclass
class StopStrings:
    """Cuts the output at the first stop string, holding back text that might start one.

    ``feed`` returns (text safe to emit, stopped). Text that is a proper prefix of a
    stop string stays buffered until the next token decides; ``flush`` releases it
    when the stream ends without a stop.
    """

    stops: list[str]
    _pending: str = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self._pending += text
        cut = min((i for s in self.stops if (i := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        keep = self._partial_suffix()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if s.startswith(self._pending[-n:]):
                    best = n
                    break
        return best
