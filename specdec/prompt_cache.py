"""Prompt caching across requests that keeps every output exact: a tree of token blocks over KV cache entries.

A prompt's KV cache is cut into blocks of B tokens at fixed absolute positions (0, B, 2B, ...), and a runtime that
caches prompts prefills every prompt in chunks along those boundaries, cache or no cache. A block's entries then
depend on the tokens up to its end alone, so a cached block is bit for bit what a cold prefill of any prompt that
starts with those tokens computes there, and a hit recomputes from the last cached boundary in the very chunks a cold
prefill would run. Only blocks that a prefill computed are cached (the runtime's side of the rule): entries written
by decoding or verify passes, an answer's tokens, came from passes of other shapes, and the prompt that resends them
prefills them again from the boundary before them.

The blocks form a tree, a block's parent the block before it, shared by every request of a model; when the cache
outgrows its budget the least recently used leaf goes first. What a block holds is the runtime's (bytes); the tree
only counts them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

DEFAULT_BUDGET_MB = 1024  # the server's --prompt-cache-mb and the generator's default: ~65,000 tokens of the default pair


class _Block:
    """B tokens that follow the tokens of its parent, and their KV cache entries."""

    __slots__ = ("tokens", "kv", "parent", "children", "used")

    def __init__(self, tokens: tuple[int, ...], kv: bytes, parent: _Block | None):
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[tuple[int, ...], _Block] = {}
        self.used = 0  # the cache's clock when a lookup or an insert last passed through it


@dataclass(frozen=True)
class PromptCacheStats:
    """What a prompt cache holds and what it saved, since it was made."""

    lookups: int  # prompts looked up
    hits: int  # of them, prompts that reused at least one block
    tokens_reused: int  # prompt tokens taken from the cache instead of prefilled
    blocks: int  # blocks held now
    bytes: int  # bytes of KV cache entries held now
    budget_bytes: int
    evictions: int  # blocks dropped to stay within the budget


class PromptCache:
    """Cached prompt blocks of one or more models, within budget_bytes of KV cache entries (0: caches nothing).

    Blocks are kept per owner: a key the runtime makes for the model and the shape of the passes that computed them
    (entries computed one way are never handed to a prefill that would compute them another way)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes (0 turns it off), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._roots: dict[tuple[Hashable, int], _Block] = {}  # (owner, block size) -> a root holding no tokens
        self._clock = self._bytes = self._blocks = 0
        self._lookups = self._hits = self._reused = self._evictions = 0
        self._lock = threading.Lock()

    @classmethod
    def of_megabytes(cls, megabytes: float) -> PromptCache:
        if megabytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 MB (0 turns it off), got {megabytes}")
        return cls(int(megabytes * 2**20))

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def match(self, owner: Hashable, tokens: Sequence[int], block: int, most: int) -> list[bytes]:
        """The cached entries of the leading full blocks of `tokens`, at most `most` of them (a prefill needs the
        logits of its last token, so it leaves at least that token's block to compute), in order; each is marked
        used."""
        with self._lock:
            self._lookups += 1
            node, found = self._roots.get((owner, block)), []
            self._clock += 1
            while node is not None and len(found) < most:
                node = node.children.get(tuple(tokens[len(found) * block:(len(found) + 1) * block]))
                if node is not None:
                    node.used = self._clock
                    found.append(node.kv)
            if found:
                self._hits += 1
                self._reused += len(found) * block
            return found

    def insert(self, owner: Hashable, tokens: Sequence[int], block: int, first: int, kvs: Sequence[bytes]) -> int:
        """Cache blocks first, first + 1, ... of `tokens` with their entries `kvs`; the blocks before `first` are those
        match() found. -> how many were kept: blocks that do not fit the budget, once every other least recently used
        leaf has gone, are not kept, and none whose earlier blocks are gone."""
        if (first + len(kvs)) * block > len(tokens):
            raise ValueError(f"blocks {first}..{first + len(kvs) - 1} of a prompt of {len(tokens)} tokens are not all "
                             f"full blocks of {block} tokens")
        if not self.enabled or not kvs:
            return 0
        with self._lock:
            self._clock += 1
            node = self._roots.setdefault((owner, block), _Block((), b"", None))
            for i in range(first):  # the blocks that match() found
                node = node.children.get(tuple(tokens[i * block:(i + 1) * block]))
                if node is None:
                    return 0
                node.used = self._clock
            kept = 0
            for i, kv in enumerate(kvs, start=first):
                key = tuple(tokens[i * block:(i + 1) * block])
                child = node.children.get(key)
                if child is None:
                    if not self._make_room(len(kv), node):
                        break
                    child = node.children[key] = _Block(key, kv, node)
                    self._bytes += len(kv)
                    self._blocks += 1
                child.used = self._clock
                node, kept = child, kept + 1
            return kept

    def _make_room(self, size: int, keep: _Block) -> bool:
        """Evict least recently used leaves, never `keep` or its ancestors, until `size` more bytes fit."""
        while self._bytes + size > self.budget_bytes:
            path = set()
            node = keep
            while node is not None:
                path.add(id(node))
                node = node.parent
            leaves = [leaf for leaf in self._leaves() if id(leaf) not in path]
            if not leaves:
                return False
            victim = min(leaves, key=lambda leaf: leaf.used)
            del victim.parent.children[victim.tokens]
            self._bytes -= len(victim.kv)
            self._blocks -= 1
            self._evictions += 1
        return True

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                yield node

    def clear(self) -> None:
        with self._lock:
            self._roots.clear()
            self._bytes = self._blocks = 0

    @property
    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(self._lookups, self._hits, self._reused, self._blocks, self._bytes,
                                self.budget_bytes, self._evictions)
