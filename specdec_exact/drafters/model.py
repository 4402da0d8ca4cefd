"""A draft model: a smaller language model that samples k tokens ahead, one forward pass each."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from specdec_exact.drafters.base import Drafter, Pools, Proposal
from specdec_exact.runtimes.base import Runner, prefill, run_through
from specdec_exact.sampling import SamplingConfig, argmax, logits_to_probs, sample


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token rows a [1, n] and b [1, m]."""
    n = min(a.shape[1], b.shape[1])
    differs = (a[0, :n] != b[0, :n]).nonzero()
    return int(differs[0, 0]) if len(differs) else n


class ModelDrafter(Drafter):
    """Drafts with any runner (a small model, or an early-exit view of the target) and keeps its cache in step."""

    name = "model"

    def __init__(self, make_runner: Callable[[], Runner], model=None, vocab_size: int | None = None):
        """make_runner: a new sequence of the draft model for each request (begin). model, vocab_size: the loaded
        draft model and the vocabulary its runners cut logits to, where forks take their sequences from a batch's
        pool of it (fork); without them a fork makes its runners as this drafter does (an early-exit view)."""
        self.make_runner, self.model, self.vocab_size = make_runner, model, vocab_size
        self.runner: Runner | None = None
        self.cached_ids = torch.zeros(1, 0, dtype=torch.long)  # the tokens whose keys/values the runner holds
        self._reading = None  # (read_ahead) the prefill under way: its generator and the tokens it reads
        # Which of this drafter and its forks is reading ahead: one at a time, as a model's prefill passes may share
        # one context for all its sequences (llama.cpp's prefill layout)
        self._reader: list[ModelDrafter | None] = [None]

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self.close()
        self.runner = self.make_runner()
        self.cached_ids = prompt_ids[:, :0]

    def fork(self, pools: Pools | None = None, shared_history: bool = True) -> ModelDrafter:
        fork = copy.copy(self)
        fork.runner, fork.cached_ids, fork._reading = None, self.cached_ids[:, :0], None
        if pools is not None and self.model is not None:
            model, size = self.model, self.vocab_size
            fork.make_runner = lambda: pools(model).take(size)
        return fork

    def close(self) -> None:
        if self._reading is not None:  # (first: its cleanup empties the sequence)
            self._reading[0].close()
            self._stop_reading()
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def tokens_behind(self, context: torch.Tensor) -> int:
        """Tokens of context [1, n] that the draft model would have to take in before its first draft token."""
        return context.shape[1] - common_prefix_length(self.cached_ids, context)

    def read_ahead(self, context: torch.Tensor, whole: bool = False) -> bool:
        """One pass of reading context [1, n] while the draft model has read nothing of this request: its prompt cut
        before the last token (which a draft feeds), in the passes of its runner's prefill (the prompt cache's segments
        where it holds them, each other segment a pass), so that a long prompt is taken in a pass per cycle beside
        other requests' decoding instead of all in one cycle; whole: every pass left. -> whether the model has caught
        up (then, or once it had read anything, draft() feeds the rest)."""
        if self._reading is None:
            if self.cached_ids.shape[1] or context.shape[1] < 2:
                return True
            if self._reader[0] is not None:  # another request's reading goes first: this one waits its turn
                return False
            prompt = context[:, :-1]
            self._reading, self._reader[0] = (prefill(self.runner, prompt), prompt), self
        return self._read(whole)

    def _read(self, whole: bool) -> bool:
        """The next pass of the reading under way (whole: every pass left) -> whether it is done."""
        steps, prompt = self._reading
        try:
            next(steps)
            if not whole:
                return False
            run_through(steps)
        except StopIteration:  # (that pass was the last)
            pass
        except BaseException:
            self._stop_reading()
            raise
        self._stop_reading()
        self.cached_ids = prompt
        return True

    def _stop_reading(self) -> None:
        self._reading = None
        if self._reader[0] is self:
            self._reader[0] = None

    def propose(self, context, k, sampling: SamplingConfig, generator) -> Proposal:
        if k == 0:
            return Proposal.empty(context.shape[0])
        draft, draft_probs = self.draft(context, k, sampling, generator)
        return Proposal(draft, draft_probs, forward_calls=k)

    def draft(self, context: torch.Tensor, k: int, sampling: SamplingConfig, generator,
              allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k tokens of the draft model after context [batch, n] (its own token ids) -> (tokens [batch, k], q
        [batch, k, vocab] or None when greedy). allowed [vocab] (bool): draft only among these tokens, q restricted
        to them and renormalised; the mass given up (summed over steps and rows, at the sampling temperature) is
        left in self.outside_mass."""
        if self._reading is not None:  # a read_ahead under way: its passes first
            self._read(whole=True)
        # Roll back to what the cache shares with the context (the rejected tail goes), then feed the rest: at least
        # the last token, whose logits give the first draft token.
        keep = min(common_prefix_length(self.cached_ids, context), context.shape[1] - 1)
        self.runner.rollback(keep)
        pending = context[:, keep:]
        tokens, probs = [], []
        self.outside_mass = 0.0
        for _ in range(k):
            logits = self.runner.forward(pending, last_only=True)[:, -1]  # [batch, vocab]
            if allowed is not None:
                scaled = logits / (sampling.temperature or 1.0)
                kept = torch.logsumexp(scaled[:, allowed], dim=-1) - torch.logsumexp(scaled, dim=-1)
                self.outside_mass += float((1 - kept.exp()).sum())
                logits = logits.masked_fill(~allowed, float("-inf"))
            if sampling.greedy:
                token, q = argmax(logits), None
            else:
                q = logits_to_probs(logits, sampling)
                token = sample(q, generator)
            tokens.append(token)
            probs.append(q)
            pending = token[:, None]
        draft = torch.stack(tokens, dim=1)  # [batch, k]
        # The last draft token was never fed: the cache holds the context and the first k-1 draft tokens.
        self.cached_ids = torch.cat([context, draft[:, :-1]], dim=1)
        return draft, None if sampling.greedy else torch.stack(probs, dim=1)  # [batch, k, vocab]
