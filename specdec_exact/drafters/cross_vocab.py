"""A draft model whose tokenizer is not the target's (SmolLM2-135M drafting for a Qwen target, say).

Both tokenizers must be byte-level BPE (GPT-2 style: Qwen, Llama 3, SmolLM2, ...): every token is then a string of
bytes, and text moves between the vocabularies without loss. Two methods, after Timor et al. (ICML 2025, "Lossless
speculative decoding algorithms for heterogeneous vocabularies"), both exact:

greedy, "draft text re-tokenized": the draft continues the committed text in its own tokens; the text it writes is
    tokenized with the target's tokenizer and proposed as target tokens. The target's argmax decides every token, so
    the output is the target's whatever the draft writes; only acceptance depends on how well the texts agree.
sampling, "shared-vocabulary rejection sampling": the draft samples only among the tokens that both vocabularies
    have (the same bytes): its logits elsewhere are masked before warping, so q is its distribution restricted to
    them and renormalised. Mapped to target ids (q = 0 on every other target token), q is a distribution over the
    target's vocabulary like any draft's, and the usual rejection rule (verify.rejection_sample) makes the output
    distributed exactly as the target's, as it does for every q.

Either way the draft model reads the committed text in its own tokens (DraftText keeps them in step, re-tokenizing
only a short tail each cycle), and each cycle's counts land in SpecStats.drafter_counts:
    cross_vocab_draft_tokens   draft-model tokens written
    cross_vocab_target_tokens  target tokens they became (greedy: re-tokenized; sampling: one each)
    cross_vocab_unshared       greedy: draft tokens with no target token of the same bytes
    cross_vocab_outside_mass   sampling: the draft's probability mass outside the shared tokens, summed over steps
                               (at the sampling temperature, before top-k / top-p), which the method gives up
"""

from __future__ import annotations

import bisect
import codecs
from itertools import accumulate
from typing import Callable

import torch

from specdec_exact.drafters.base import Proposal
from specdec_exact.drafters.model import ModelDrafter, common_prefix_length
from specdec_exact.vocabulary import IncompatibleVocabulary, TokenText
from specdec_exact.runtimes.base import Runner
from specdec_exact.sampling import SamplingConfig

GREEDY_METHOD = "draft text re-tokenized"
SAMPLING_METHOD = "shared-vocabulary rejection sampling"


def token_bytes(tokenizer, size: int) -> list[bytes | None]:
    """The bytes of each token id below size (None for ids the tokenizer does not have, such as output-layer rows
    padded beyond it). Special tokens are their text."""
    text = TokenText(tokenizer)
    if not text.byte_level:
        raise IncompatibleVocabulary(
            f"drafting across vocabularies needs byte-level BPE tokenizers (GPT-2 style, as Qwen, Llama 3 and "
            f"SmolLM2 have), which {type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')!r} is not. Use "
            "a draft model with the target's tokenizer, or one with a byte-level BPE tokenizer")
    return [text.piece_bytes(i) for i in range(size)]


class Vocabularies:
    """How the target's tokens and the draft's relate: each token's bytes, and the tokens both have."""

    def __init__(self, target_tokenizer, target_size: int, draft_tokenizer, draft_size: int):
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_size, self.draft_size = target_size, draft_size
        self.target_bytes = token_bytes(target_tokenizer, target_size)
        self.draft_bytes = token_bytes(draft_tokenizer, draft_size)
        target_id: dict[bytes, int] = {}
        for i, piece in enumerate(self.target_bytes):
            if piece:
                target_id.setdefault(piece, i)  # a duplicate (an added token spelling a plain one) keeps the first
        self.draft_to_target = torch.tensor([target_id.get(piece, -1) if piece else -1 for piece in self.draft_bytes])
        self.shared = self.draft_to_target >= 0  # [draft_size] bool: draft tokens the target also has
        if not self.shared.any():
            raise IncompatibleVocabulary("the target's and the draft's vocabularies share no token")

    def draft_ids(self, text: str) -> list[int]:
        return self.draft_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def target_ids(self, text: str) -> list[int]:
        return self.target_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def to_target(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """q over the draft's vocabulary [..., draft_size], zero outside the shared tokens -> the same q over the
        target's [..., target_size]."""
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.target_size)
        out[..., self.draft_to_target[self.shared]] = draft_probs[..., self.shared]
        return out

    def describe(self) -> str:
        """What a user is told when the generator drafts across vocabularies."""
        return (f"the draft's vocabulary differs from the target's (target {self.target_size} tokens, draft "
                f"{self.draft_size}, {int(self.shared.sum())} the same bytes in both): greedy requests draft by "
                f"{GREEDY_METHOD}, sampled ones by {SAMPLING_METHOD}; the output is the target's either way")


class DraftText:
    """The committed text of one request in the draft's tokens, kept in step with the target's committed tokens.

    Each update re-tokenizes the new text together with a short tail before it (TAIL bytes, from a draft-token
    boundary on a character boundary), since merges can reach across the old end; the tokens before the tail stay.
    The result may now and then differ from tokenizing the whole text at once: that only changes what the draft
    reads, never what the target commits."""

    TAIL = 32

    def __init__(self, vocab: Vocabularies):
        self.vocab = vocab
        self.n_target = 0  # committed target tokens taken in so far
        self.text = bytearray()  # their bytes
        self.ids: list[int] = []  # the draft's tokens for the text up to the last complete character
        self.ends: list[int] = []  # the byte offset at which each of ids ends

    def update(self, context: torch.Tensor) -> torch.Tensor:
        """context [1, n]: every committed target token (a continuation of the previous call's) -> the draft's
        tokens for its text [1, m]."""
        new = context[0, self.n_target:].tolist()
        self.n_target = context.shape[1]
        self.text += b"".join(self.vocab.target_bytes[t] or b"" for t in new)
        covered = self.ends[-1] if self.ends else 0
        keep = bisect.bisect_right(self.ends, covered - self.TAIL)
        while keep and self.ends[keep - 1] < len(self.text) and self.text[self.ends[keep - 1]] & 0xC0 == 0x80:
            keep -= 1  # a boundary inside a character: step back to one between characters
        start = self.ends[keep - 1] if keep else 0
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # holds back an incomplete last character
        ids = self.vocab.draft_ids(decoder.decode(bytes(self.text[start:])))
        self.ids[keep:] = ids
        self.ends[keep:] = list(accumulate((len(self.vocab.draft_bytes[i] or b"") for i in ids), initial=start))[1:]
        return torch.tensor([self.ids], dtype=torch.long)


class CrossVocabDrafter(ModelDrafter):
    """A draft model with its own vocabulary behind the drafter protocol: its proposals are target tokens (see the
    module's docstring for the two methods)."""

    def __init__(self, make_runner: Callable[[], Runner], vocab: Vocabularies, model=None,
                 vocab_size: int | None = None):
        super().__init__(make_runner, model, vocab_size)
        self.vocab = vocab
        self.text: DraftText | None = None

    def begin(self, prompt_ids: torch.Tensor) -> None:
        super().begin(prompt_ids)
        self.text = DraftText(self.vocab)

    def fork(self, pools=None, shared_history=True) -> CrossVocabDrafter:
        fork = super().fork(pools, shared_history)
        fork.text = None
        return fork

    def tokens_behind(self, context: torch.Tensor) -> int:
        """Roughly: the committed target tokens not yet taken in (the draft's own tokens for them are not counted
        until it drafts) plus the draft tokens of earlier updates that its cache lacks."""
        return context.shape[1] - self.text.n_target + len(self.text.ids) - common_prefix_length(
            self.cached_ids, torch.tensor([self.text.ids], dtype=torch.long))

    def read_ahead(self, context: torch.Tensor, whole: bool = False) -> bool:
        """ModelDrafter.read_ahead over the committed text in the draft's tokens."""
        return super().read_ahead(self.text.update(context), whole)

    def propose(self, context, k, sampling: SamplingConfig, generator) -> Proposal:
        draft_context = self.text.update(context)
        if k == 0 or draft_context.shape[1] == 0:
            return Proposal.empty(context.shape[0])
        if sampling.greedy:
            return self._write_text(draft_context, k, sampling, generator)
        return self._sample_shared(draft_context, k, sampling, generator)

    def _write_text(self, draft_context, k, sampling, generator) -> Proposal:
        draft, _ = self.draft(draft_context, k, sampling, generator)
        ids = draft[0].tolist()
        # The draft's text on its own: the committed tokens are fixed, so the target continues after them, and an
        # incomplete last character waits for the next cycle.
        written = b"".join(self.vocab.draft_bytes[i] or b"" for i in ids)
        tokens = self.vocab.target_ids(codecs.getincrementaldecoder("utf-8")("replace").decode(written))[:k]
        # (a tokenizer may hold added tokens beyond the target's output layer: the proposal stops before one)
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t >= self.vocab.target_size), len(tokens))]
        counts = {"cross_vocab_draft_tokens": k, "cross_vocab_target_tokens": len(tokens),
                  "cross_vocab_unshared": int((~self.vocab.shared[draft[0]]).sum())}
        return Proposal(torch.tensor([tokens], dtype=torch.long), None, forward_calls=k, counts=counts)

    def _sample_shared(self, draft_context, k, sampling, generator) -> Proposal:
        draft, probs = self.draft(draft_context, k, sampling, generator, allowed=self.vocab.shared)
        counts = {"cross_vocab_draft_tokens": k, "cross_vocab_target_tokens": k,
                  "cross_vocab_outside_mass": self.outside_mass}
        return Proposal(self.vocab.draft_to_target[draft], self.vocab.to_target(probs), forward_calls=k,
                        counts=counts)
