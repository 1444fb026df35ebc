"""Text as it is generated: ids -> UTF-8 completed across tokens, stop strings held back until they are known
not to be one, and the `Piece`s a sampler hands out.

    stream = TextStream(tokenizer, stops=["\\n\\n"])
    piece = stream.piece(sample=0, token=id, ends=frozenset({tokenizer.eot_token}), last=False)

Footguns
- A stop string is never printed, even across token boundaries: text that could start one waits.
- An incomplete character left at the very end (the length limit cut it) is dropped, not printed as U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpt.data.tokenizer import StreamDecoder, Tokenizer


class StopMatcher:
    """Releases text as it arrives, holding back any tail that could begin a stop string.

    `push(text)` returns (text safe to show, whether a stop string was found); after a hit, the text
    before the earliest match is released and the rest discarded.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:  # the longest tail of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """One sample's ids -> text: UTF-8 completed across tokens, then stop strings held back."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.utf8 = StreamDecoder(tokenizer)
        self.stops = StopMatcher(stops)

    def push(self, token: int) -> tuple[str, bool]:
        return self.stops.push(self.utf8.push([token]))

    def finish(self) -> str:
        """What is held back, at the end (an incomplete trailing character is dropped)."""
        return self.stops.flush()

    def piece(self, sample: int, token: int, ends: frozenset[int], last: bool) -> Piece:
        """The Piece that `token`, the next id of `sample`, makes; its `finish` is set when the sample
        ends here: at one of the `ends` ids (end-of-text, a chat's end of turn), at a stop string, or at
        the `last` token allowed."""
        if token in ends:
            return Piece(sample, self.finish(), [token], "eot")
        text, hit = self.push(token)
        if hit:
            return Piece(sample, text, [token], "stop")
        if last:
            return Piece(sample, text + self.finish(), [token], "length")
        return Piece(sample, text, [token])


@dataclass
class Piece:
    """A step of one sample: the text it adds (possibly "" while held back) and the ids behind it.

    `ids` holds the token generated at this step (end-of-text and the tokens of a stop string
    included, though their text is not); `finish` is None until the sample's last piece, then
    "eot" (end-of-text), "stop" (a stop string) or "length" (max_new_tokens reached).
    `logprobs` (only for a request that asks for them, `gpt.infer.batching`) holds a `TokenLogprob`
    per id this piece accounts for: the prompt's first (under echo), then the generated one.
    """

    sample: int
    text: str
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: list | None = None
