"""Drafters, selected by name (`--draft NAME[:ARG]`) from a registry, or built from a draft model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from specdec_exact.drafters.base import Drafter, NoDrafter, Proposal
from specdec_exact.drafters.cross_vocab import CrossVocabDrafter, Vocabularies
from specdec_exact.drafters.model import ModelDrafter
from specdec_exact.vocabulary import IncompatibleVocabulary, own_vocab_size, shared_vocab_size, vocabulary_difference
from specdec_exact.runtimes import TORCH, Runtime, runtime_of


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may build on: the loaded target (shared, never copied) and its vocabulary."""
    model: object
    tokenizer: object
    vocab_size: int
    dtype: torch.dtype
    draft_quantization: str | None = None  # applied to a draft model that a drafter loads (see models.QUANTIZATIONS)
    runtime: Runtime = TORCH  # a draft model loads on the target's runtime
    threads: int | None = None

    def load_draft(self, spec, tokenizer=None):
        """A draft model given like the target (path, .gguf, registry name) -> (model, tokenizer), on this runtime."""
        # A draft only proposes, so "int8" takes torch's cheaper per-pass int8 (see models.QUANTIZATIONS).
        quantization = "int8-per-pass" if self.draft_quantization == "int8" else self.draft_quantization
        return self.runtime.load(spec, tokenizer, dtype=self.dtype, quantization=quantization, threads=self.threads)


# name -> factory(target, argument after the colon or None) -> (drafter, draft model or None)
DRAFTERS: dict[str, Callable[[TargetInfo, str | None], tuple[Drafter, object]]] = {}


def register(name: str):
    def add(factory):
        DRAFTERS[name] = factory
        return factory
    return add


@register("none")
def _no_drafter(target: TargetInfo, arg: str | None):
    return NoDrafter(), None


def model_drafter(draft_model, target: TargetInfo, draft_tokenizer=None) -> ModelDrafter:
    """A draft model behind the drafter protocol, checked for rollback support; one with a vocabulary of its own
    drafts across vocabularies (drafters.cross_vocab)."""
    runtime_of(draft_model).check_rollback(draft_model)
    vocab = _other_vocabulary(draft_model, target, draft_tokenizer)
    size = vocab.draft_size if vocab else shared_vocab_size(target.model, target.tokenizer, draft_model,
                                                            draft_tokenizer)
    runtime = runtime_of(draft_model)
    make_runner = lambda: runtime.pool(draft_model).take(size)  # noqa: E731  (a fork takes a batch's pool instead)
    if vocab:
        return CrossVocabDrafter(make_runner, vocab, draft_model, size)
    return ModelDrafter(make_runner, draft_model, size)


def _other_vocabulary(draft_model, target: TargetInfo, draft_tokenizer) -> Vocabularies | None:
    """How the draft's vocabulary maps to the target's where the tokenizers differ; None where they are the same
    (or either is unknown: then shared_vocab_size compares the output layers)."""
    if target.tokenizer is None or draft_tokenizer is None:
        return None
    difference = vocabulary_difference(target.tokenizer, draft_tokenizer)
    if difference is None:
        return None
    try:
        return Vocabularies(target.tokenizer, target.vocab_size, draft_tokenizer,
                            own_vocab_size(draft_model, draft_tokenizer))
    except IncompatibleVocabulary as error:
        raise IncompatibleVocabulary(f"{difference}, and {error}") from None


def names_a_model(spec) -> bool:
    """Whether build_drafter would load `spec` as a draft model (a path or registry name, not a drafter's name)."""
    return isinstance(spec, os.PathLike) or isinstance(spec, str) and spec.partition(":")[0] not in DRAFTERS


def build_drafter(spec, target: TargetInfo, draft_tokenizer=None) -> tuple[Drafter, object]:
    """None | Drafter | registered name | draft model, path or registry model name -> (drafter, draft model or None)."""
    if spec is None:
        return NoDrafter(), None
    if isinstance(spec, Drafter):
        return spec, spec.model
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name in DRAFTERS:
            return DRAFTERS[name](target, arg or None)
    draft_model, draft_tokenizer = target.load_draft(spec, draft_tokenizer)
    return model_drafter(draft_model, target, draft_tokenizer), draft_model


__all__ = ["DRAFTERS", "CrossVocabDrafter", "Drafter", "ModelDrafter", "NoDrafter", "Proposal", "TargetInfo",
           "build_drafter", "model_drafter", "names_a_model", "register"]

# Imported last: each module registers its drafters with `register`, defined above.
from specdec_exact.drafters.early_exit import EarlyExitRunner, early_exit_drafter  # noqa: E402
from specdec_exact.drafters.hybrid import HybridDrafter  # noqa: E402
from specdec_exact.drafters.ngram import NgramDrafter, find_continuation  # noqa: E402
from specdec_exact.drafters.suffix import SuffixDrafter, suffix_draft  # noqa: E402

__all__ += ["EarlyExitRunner", "HybridDrafter", "NgramDrafter", "SuffixDrafter", "early_exit_drafter",
            "find_continuation", "suffix_draft"]
