"""Vocabularies: how many token ids a target and a drafter mean the same thing by, and where two tokenizers differ."""

from __future__ import annotations

import json

from specdec_exact.runtimes import runtime_of


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


class TokenText:
    """Each token id's bytes: a byte-level BPE piece (GPT-2 style, as Qwen, Llama 3 and SmolLM2 have) mapped back to
    the bytes it stands for, a special token's text; and as text, those bytes decoded (a piece that is part of a
    character shows as U+FFFD). A tokenizer of another kind gives each token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._known: dict[int, bytes] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and _is_byte_level(json.loads(backend.to_str()).get("decoder"))
        if self.byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
            self._added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
            self._backend = backend

    def piece_bytes(self, token: int) -> bytes | None:
        """A byte-level tokenizer's token as bytes (None for an id it does not have, such as output-layer rows
        padded beyond it)."""
        if token in self._added:
            return self._added[token].encode()
        piece = self._backend.id_to_token(token)
        if piece is None:
            return None
        return bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece) else piece.encode()

    def bytes(self, token: int) -> bytes:
        found = self._known.get(token)
        if found is None:
            piece = self.piece_bytes(token) if self.byte_level else None
            found = self._known[token] = piece if piece is not None else self.tokenizer.decode([token]).encode()
        return found

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"
