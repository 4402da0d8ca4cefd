"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regular expression or a Lark grammar) that the
output must follow, enforced by llguidance on the target's logits.

The target's distribution under a grammar is the masked one: at every position the tokens the grammar forbids there
get no probability. A verify pass gives rows for several positions at once, and the mask at a draft position depends
on the draft tokens before it: Constraint.masks consumes the draft tentatively, takes the mask after each token, and
rolls back. So every row is masked exactly as decoding one token at a time would mask it, a draft token the grammar
forbids is rejected as the target would reject it, greedy output equals target-only constrained decoding's, and a
sample is distributed as its samples are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch


class GrammarError(ValueError):
    """A grammar (or schema) that cannot be compiled, or output that left it."""


@dataclass(frozen=True)
class Grammar:
    """A compiled-on-use grammar in llguidance's form, and what it was made from (for messages)."""

    source: str  # llguidance's grammar (JSON text, as LLMatcher.grammar_from_* gives it)
    what: str  # "a JSON object", "JSON schema 'name'", ...

    @classmethod
    def json_schema(cls, schema: dict | bool, name: str | None = None) -> Grammar:
        from llguidance import LLMatcher

        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        try:
            source = LLMatcher.grammar_from_json_schema(schema)
        except ValueError as error:
            raise GrammarError(f"the JSON schema cannot be used: {error}") from None
        return cls(source, f"JSON schema {name!r}" if name else "the JSON schema").checked()

    @classmethod
    def json_object(cls) -> Grammar:
        return cls.json_schema({"type": "object"}, None)._named("a JSON object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        from llguidance import LLMatcher

        return cls(LLMatcher.grammar_from_regex(pattern), f"the regular expression {pattern!r}").checked()

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        from llguidance import LLMatcher

        return cls(LLMatcher.grammar_from_lark(grammar), "the Lark grammar").checked()

    def _named(self, what: str) -> Grammar:
        return Grammar(self.source, what)

    def checked(self) -> Grammar:
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(self.source)
        if failed:
            raise GrammarError(f"{self.what} cannot be used: {messages[0]}")
        return self


class GrammarTokenizer:
    """llguidance's view of a tokenizer (about a second to build, so built once per generator), the logits' size
    (vocab_size: masks are cut or padded to it) and the ids that end generation."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        import llguidance.hf

        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids))
        except ValueError as error:
            raise GrammarError(f"grammars need a tokenizer that llguidance reads (a fast Hugging Face tokenizer of a "
                               f"known kind); this model's cannot be used ({error})") from None


class Constraint:
    """One sequence's place in its grammar: the tokens it has committed consumed, and the mask of what may come
    next (for several positions of a draft at once)."""

    def __init__(self, grammar: Grammar, tokenizer: GrammarTokenizer):
        from llguidance import LLMatcher

        self.grammar, self.vocab_size, self.eos_ids = grammar, tokenizer.vocab_size, tokenizer.eos_ids
        self.matcher = LLMatcher(tokenizer.tokenizer, grammar.source, log_level=0)
        self._check()

    def masks(self, fed: list[int], rows: int) -> torch.Tensor:
        """The allowed tokens [rows, vocab] (bool) at `rows` consecutive positions: row 0 here, row j after the first
        j tokens of `fed` too. Rows after a fed token the grammar forbids are never used (that token is rejected at
        the row before) and repeat the last mask. The matcher is left as it was."""
        out, consumed = [self._mask()], 0
        for token in fed[:rows - 1]:
            if token in self.eos_ids or not self._allows(out[-1], token) or self.matcher.validate_tokens([token]) != 1:
                break  # (after an end of sequence nothing follows; a forbidden token is rejected where it stands)
            self.matcher.consume_token(token)
            consumed += 1
            out.append(self._mask())
        if consumed:
            self.matcher.rollback(consumed)
        out += [out[-1]] * (rows - len(out))
        return torch.stack(out)

    def commit(self, tokens: list[int]) -> None:
        """These tokens were committed (each allowed where it stands)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            self._check()

    def _allows(self, mask: torch.Tensor, token: int) -> bool:
        return 0 <= token < len(mask) and bool(mask[token])

    def _mask(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self.vocab_size, dtype=bool)  # (ids the tokenizer has that the logits lack: never allowed)
        allowed[:min(len(bits), self.vocab_size)] = bits[:self.vocab_size]
        return torch.from_numpy(allowed)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.grammar.what}: {self.matcher.get_error()}")


def apply(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with the tokens not allowed ([n, vocab] bool) at -inf (a new tensor)."""
    return logits.float().masked_fill(~allowed, float("-inf"))


def schema_of(response_format: dict) -> Grammar | None:
    """OpenAI's response_format -> its grammar: {"type": "text"} none; {"type": "json_object"} any JSON object;
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} that schema. Bad shapes: GrammarError."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return Grammar.json_schema(spec["schema"], spec.get("name"))
    raise GrammarError(f"response_format type must be text, json_object or json_schema, got {json.dumps(kind)}")
