"""Vocabularies: how many token ids a target and a drafter mean the same thing by, and where two tokenizers differ."""

from __future__ import annotations

from specdec.runtimes import runtime_of


class IncompatibleVocabulary(ValueError):
    """Target and drafter do not share a vocabulary, so q and p would not be over the same tokens."""


def model_vocab_size(model) -> int:
    return runtime_of(model).vocab_size(model)


def shared_vocab_size(target, target_tokenizer, draft, draft_tokenizer) -> int:
    """The number of token ids that target and drafter both mean the same thing by (the same vocabulary required).

    Output layers padded beyond the tokenizer (common in the Qwen family) are fine: only the tokenizer's range is used.
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        difference = vocabulary_difference(target_tokenizer, draft_tokenizer)
        if difference is not None:
            raise IncompatibleVocabulary(f"{difference}. Use a draft model of the same family as the target.")
    elif model_vocab_size(target) != model_vocab_size(draft):
        raise IncompatibleVocabulary(
            f"target vocabulary has {model_vocab_size(target)} tokens, draft has {model_vocab_size(draft)}; "
            "without tokenizers to compare, the output layers must be the same size")
    return min(own_vocab_size(target, target_tokenizer), own_vocab_size(draft, draft_tokenizer))


def vocabulary_difference(target_tokenizer, draft_tokenizer) -> str | None:
    """None when the two tokenizers give every token the same id, else where they first differ, in words."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return None
    by_id_t = {i: t for t, i in target_vocab.items()}
    by_id_d = {i: t for t, i in draft_vocab.items()}
    first = next(i for i in range(max(len(by_id_t), len(by_id_d)) + 1) if by_id_t.get(i) != by_id_d.get(i))
    return (f"target and draft tokenizers differ (target {len(target_vocab)} tokens, draft {len(draft_vocab)}); "
            f"first difference at id {first}: target {by_id_t.get(first)!r} vs draft {by_id_d.get(first)!r}")


def own_vocab_size(model, tokenizer) -> int:
    """The usable vocabulary of one model: its tokenizer's range (capped by its output layer), or its output layer."""
    rows = model_vocab_size(model)
    return min(len(tokenizer), rows) if tokenizer is not None else rows
