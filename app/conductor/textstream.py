"""Token IDs -> client text, in one place for every pipeline.

Engines return token IDs only, so a request's text is assembled here whether
its tokens came from one engine or from RLD then MD. Stop strings are matched
on the assembled text, so one spanning a handoff is still found, and text that
could still become a stop string is held back until it cannot. As in vLLM, no
stop string ends the output within its first `min_tokens` tokens, and the stop
string, or the text of the stop token the engine ended on, is left out unless
`include_stop` asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass
class TextDelta:
    text: str
    """New text for the client (may be empty while a stop string is possible)."""
    num_tokens: int
    """Tokens of this feed that count (all of them, or those up to a stop string)."""
    stopped: bool = False
    """A stop string matched: the request is complete and the rest is discarded."""


class TextAssembler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        *,
        min_tokens: int = 0,
        stop_token_ids: list[int] | None = None,
        include_stop: bool = False,
        context_tokens: int = 8,
    ):
        self._tokenizer = tokenizer
        # A little prompt context lets the decoder place the first word's space right.
        self._stream = DecodeStream(ids=prompt_token_ids[-context_tokens:], skip_special_tokens=True)
        self._stops = [s for s in (stop or []) if s]
        self._min_tokens = min_tokens
        self._stop_ids = frozenset(stop_token_ids or ())
        self._include_stop = include_stop
        self._pending = ""  # decoded text not yet sent (could begin a stop string)
        self.text = ""  # everything sent so far
        self.num_tokens = 0
        self.stopped = False

    def feed(self, token_ids: list[int]) -> TextDelta:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped:
            return TextDelta("", 0, stopped=True)
        for i, tid in enumerate(token_ids):
            piece = self._stream.step(self._tokenizer, tid)
            self.num_tokens += 1
            if tid in self._stop_ids:  # the engine ends on it (never before min_tokens: vLLM masks it till then)
                if piece and self._include_stop:
                    self._pending += piece
                self.stopped = True
                return TextDelta(self._flush_pending(), i + 1, stopped=True)
            if piece:
                self._pending += piece
            if self._stops and self.num_tokens > self._min_tokens and self._match_stop():
                return TextDelta(self._flush_pending(), i + 1, stopped=True)
        return TextDelta(self._release(), len(token_ids))

    def finish(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        return self._flush_pending()

    def _match_stop(self) -> bool:
        # Pending text is short: at most a held-back stop prefix plus the newest piece.
        hits = [(i, i + len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if not hits:
            return False
        start, end = min(hits)
        self._pending = self._pending[: end if self._include_stop else start]
        self.stopped = True
        return True

    def _release(self) -> str:
        """Send all pending text except a tail that is a prefix of some stop string."""
        if not self._stops:
            return self._flush_pending()
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold :]
        self.text += out
        return out

    def _flush_pending(self) -> str:
        out, self._pending = self._pending, ""
        self.text += out
        return out
