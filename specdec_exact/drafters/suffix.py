"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024): continue the context the way its longest repeated suffix
continued before, in this request or in earlier ones, following the most frequent continuation.

Where prompt lookup copies what followed the last occurrence of a short n-gram, this drafter matches the longest
suffix of the context (up to max_match tokens) that occurred before, in the prompt, the output so far, or the text of
earlier requests served by the same generator, and walks the tree of what followed all those occurrences, taking the
most frequent token each step. It drafts further the longer the match and the more the occurrences agree: a token is
drafted while the estimated probability of the whole draft so far (the product of each step's agreeing share) stays
above min_probability. A lookup is a few vectorised passes over the corpus (tens of microseconds for 100k tokens), so
drafts cost next to nothing. Deterministic: q is one-hot, and the verifier keeps sampling exact.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from specdec_exact.drafters import TargetInfo, register
from specdec_exact.drafters.base import Drafter, Proposal

SEPARATOR = -1  # between documents of the corpus: matches no token, so no match or continuation crosses it


def suffix_draft(corpus: np.ndarray, k: int, max_match: int = 32, min_probability: float = 0.3,
                 tokens_per_matched: float = 1.0) -> tuple[list[int], int, list[float]]:
    """Draft up to k tokens continuing corpus (1-D ids; its tail is the context; SEPARATOR between documents).

    -> (draft tokens, length of the matched suffix, estimated probability of each draft prefix). The draft is at most
    tokens_per_matched x the matched length long (a long match predicts far, a one-token match a little).
    """
    end = len(corpus)
    if k <= 0 or end < 2:
        return [], 0, []
    # Occurrences of ever longer suffixes: candidate i is an earlier position where corpus[i - m + 1 .. i] equals the
    # last m tokens. Start from the last token's occurrences (the end itself excluded), then extend backwards.
    candidates = np.flatnonzero(corpus[:end - 1] == corpus[end - 1])
    matched = 1 if len(candidates) else 0
    while 0 < matched < min(max_match, end - 1):
        wanted = corpus[end - 1 - matched]
        if wanted == SEPARATOR:
            break
        back = candidates - matched
        agree = back >= 0
        agree[agree] = corpus[back[agree]] == wanted
        if not agree.any():
            break
        candidates = candidates[agree]
        matched += 1
    if matched == 0:
        return [], 0, []
    draft, probabilities, probability = [], [], 1.0
    limit = min(k, max(1, int(tokens_per_matched * matched)))
    positions = candidates + 1  # where each occurrence's continuation starts
    while len(draft) < limit:
        positions = positions[positions < end]
        if not len(positions):
            break
        following = corpus[positions]
        following = following[following != SEPARATOR]
        if not len(following):
            break
        values, counts = np.unique(following, return_counts=True)
        best = int(np.argmax(counts))  # ties: the smallest token id, deterministically
        share = counts[best] / len(positions)
        if probability * share < min_probability:
            break
        probability *= share
        token = int(values[best])
        draft.append(token)
        probabilities.append(probability)
        positions = positions[corpus[positions] == token] + 1
    return draft, matched, probabilities


class DraftHistory:
    """The text of earlier requests, kept for suffix lookup: the most recent max_tokens tokens of them, oldest dropped
    first, each followed by SEPARATOR. One store is shared by every fork of a drafter (SuffixDrafter.fork), so that
    requests decoded side by side, and one after another, draft from each other's text."""

    def __init__(self, max_tokens: int = 200_000):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._texts: deque[np.ndarray] = deque()
        self._tokens = 0
        self.corpus = np.full(0, SEPARATOR, dtype=np.int64)  # the joined history

    def __len__(self) -> int:
        """Texts held."""
        return len(self._texts)

    def remember(self, tokens: np.ndarray) -> None:
        """Keep one finished request's text (prompt and output)."""
        if self.max_tokens == 0 or not len(tokens):
            return
        self._texts.append(np.append(tokens[-self.max_tokens:], SEPARATOR))
        self._tokens += len(self._texts[-1])
        while self._tokens > self.max_tokens and len(self._texts) > 1:
            self._tokens -= len(self._texts.popleft())
        self.corpus = np.concatenate(list(self._texts))


class SuffixDrafter(Drafter):
    """Drafts with suffix_draft over this request's context plus the text of earlier requests (a DraftHistory)."""

    name = "suffix"

    def __init__(self, max_match: int = 32, min_probability: float = 0.3, max_history_tokens: int = 200_000,
                 history: DraftHistory | None = None):
        if max_match < 1 or not 0.0 <= min_probability <= 1.0 or max_history_tokens < 0:
            raise ValueError("need max_match >= 1, min_probability in [0, 1], max_history_tokens >= 0")
        self.max_match, self.min_probability = max_match, min_probability
        self.history = history if history is not None else DraftHistory(max_history_tokens)
        self._last_context: np.ndarray | None = None  # the current request's text as last seen
        self.last_match = 0  # matched suffix length of the last proposal (for a chooser, and the curious)
        self.last_probabilities: list[float] = []
        self.last_agreement = 1.0  # the share of the matched occurrences that went on with the first draft token

    def fork(self, pools=None, shared_history: bool = True) -> SuffixDrafter:
        """The same settings and, with shared_history, the same history (which the fork extends when its request
        ends); without, a history of its own, empty."""
        history = self.history if shared_history else DraftHistory(self.history.max_tokens)
        return SuffixDrafter(self.max_match, self.min_probability, self.history.max_tokens, history)

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self._end_request()

    def close(self) -> None:
        self._end_request()

    def _end_request(self) -> None:
        if self._last_context is not None:
            self.history.remember(self._last_context)
        self._last_context = None

    def propose(self, context, k, sampling, generator) -> Proposal:
        if context.shape[0] != 1:
            raise ValueError(f"suffix drafting drafts one sequence at a time, got a batch of {context.shape[0]}")
        self._last_context = context[0].numpy()
        corpus = self.history.corpus
        corpus = np.concatenate([corpus, self._last_context]) if len(corpus) else self._last_context
        draft, self.last_match, self.last_probabilities = suffix_draft(corpus, k, self.max_match,
                                                                       self.min_probability)
        self.last_agreement = self.last_probabilities[0] if self.last_probabilities else 1.0
        return Proposal(torch.tensor([draft], dtype=torch.long).reshape(1, len(draft)))


@register("suffix")
def _suffix(target: TargetInfo, arg: str | None):
    """`suffix` or `suffix:N`: the longest suffix matched is N tokens (default 32)."""
    from specdec_exact.drafters.ngram import parse_positive_int

    return SuffixDrafter(parse_positive_int(arg, "suffix:N (the longest match)") if arg else 32), None
