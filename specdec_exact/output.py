"""A request's output: its committed tokens turned into text as they come (never half a character, never a prefix
of a stop string), chunk by chunk, and gathered into a result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdec_exact.engine import Step
from specdec_exact.logprobs import TokenLogprob
from specdec_exact.metrics import SpecStats


@dataclass
class Chunk:
    """What one cycle adds to the output, as soon as it is committed."""
    text: str  # new text since the previous chunk (held back while it may be the start of a stop string)
    token_ids: list[int]  # tokens committed by this cycle
    n_from_draft: int  # the first n_from_draft token_ids were authored by the drafter and accepted by the target
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    stats: SpecStats | None = None  # set on the last chunk
    logprobs: list[TokenLogprob] | None = None  # per token, where the request asks for them


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (no prompt, no end-of-sequence token)
    text: str  # decoded new tokens, cut before any stop string ("" without a tokenizer)
    stats: SpecStats
    finish_reason: str
    from_draft: list[bool] = field(default_factory=list)  # per token: authored by the drafter
    logprobs: list[TokenLogprob] | None = None  # per token, where asked for (generate(logprobs=...))


class Output:
    """A request's steps turned into chunks (text detokenized, cut at stop strings) and gathered into a result."""

    def __init__(self, tokenizer, stop: Sequence[str], stats: SpecStats, logprobs: bool = False):
        self.text = Detokenizer(tokenizer, stop)
        self.stats = stats  # the request's, carried on its last chunk (the engine keeps them)
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.texts: list[str] = []
        self.finish_reason: str | None = None

    def chunk(self, step: Step) -> Chunk:
        """The chunk of one cycle's step. A stop string ends the output within the step: the chunk then holds the
        fewest tokens that complete it, and finish_reason "stop" (the decoding must be told: Decoding.stop_at)."""
        delta, kept, stopped = self.text.add(step.tokens)
        tokens, n_from_draft = step.tokens[:kept], min(step.n_from_draft, kept)
        logprobs = list(step.logprobs[:kept]) if self.logprobs is not None else None
        if stopped:
            return Chunk(delta, tokens, n_from_draft, "stop", self.stats, logprobs)
        if step.finish_reason:
            return Chunk(delta + self.text.flush(), tokens, n_from_draft, step.finish_reason, self.stats, logprobs)
        return Chunk(delta, tokens, n_from_draft, logprobs=logprobs)

    def end(self) -> Chunk:
        """The last chunk when generation ended without a finish reason (no tokens asked for)."""
        return Chunk(self.text.flush(), [], 0, "length", self.stats, [] if self.logprobs is not None else None)

    def collect(self, chunk: Chunk) -> Chunk:
        self.token_ids += chunk.token_ids
        if self.logprobs is not None:
            self.logprobs += chunk.logprobs or []
        self.from_draft += [i < chunk.n_from_draft for i in range(len(chunk.token_ids))]
        self.texts.append(chunk.text)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        return chunk

    def result(self) -> GenerationResult:
        return GenerationResult(self.token_ids, "".join(self.texts), self.stats, self.finish_reason,
                                self.from_draft, self.logprobs)


DECODE_WINDOW = 6  # tokens before the new ones that each step decodes again, for their context


class Detokenizer:
    """Incremental decoding that never emits half a character or a prefix of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        # The text of the ids up to the last step that ended in whole characters, and of its last few tokens decoded
        # from ids[_window] on: each step decodes from _window only, not the whole output again (that was quadratic
        # in its length). A tokenizer decodes a token by its neighbours (a leading space dropped at the start of a
        # decode), so new text is what decoding from _window gives beyond _window_text.
        self._text, self._window, self._window_text = "", 0, ""

    def add(self, tokens: list[int]) -> tuple[str, int, bool]:
        """-> (text safe to emit now, how many of tokens to keep, whether a stop string was reached: then generation
        ends here, after the fewest tokens that complete it, and nothing from the stop string on is emitted)."""
        if self.tokenizer is None:
            return "", len(tokens), False
        text = self._decode(tokens)
        if self._stop_in(text) is not None:
            kept = next(n for n in range(1, len(tokens) + 1) if self._stop_in(self._decode(tokens[:n])) is not None)
            text = self._decode(tokens[:kept])
            self.ids += tokens[:kept]
            self._settle(text)
            delta, self.sent = text[self.sent:self._stop_in(text)], len(text)
            return delta, kept, True
        self.ids += tokens
        self._settle(text)
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character waits for its remaining tokens
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if text[safe - n:safe] == s[:n]:
                    safe -= n
                    break
        delta, self.sent = text[self.sent:safe], max(self.sent, safe)
        return delta, len(tokens), False

    def _decode(self, extra: list[int] = ()) -> str:
        """The text of self.ids + extra."""
        tail = self.tokenizer.decode(self.ids[self._window:] + list(extra), skip_special_tokens=True)
        if not tail.startswith(self._window_text):  # the window decodes otherwise in context: decode it all
            return self.tokenizer.decode(self.ids + list(extra), skip_special_tokens=True)
        return self._text + tail[len(self._window_text):]

    def _settle(self, text: str) -> None:
        """self.ids (just extended) decode to text: where it ends in whole characters, the next decodes start from a
        window of the last few tokens."""
        if text.endswith("\ufffd"):
            return
        self._text, self._window = text, max(0, len(self.ids) - DECODE_WINDOW)
        self._window_text = self.tokenizer.decode(self.ids[self._window:], skip_special_tokens=True)

    def _stop_in(self, text: str) -> int | None:
        """Where the first stop string starts in text (searching only what was not sent yet), or None."""
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def flush(self) -> str:
        """The text held back so far (at the end of generation)."""
        if self.tokenizer is None:
            return ""
        text = self._decode()
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta
