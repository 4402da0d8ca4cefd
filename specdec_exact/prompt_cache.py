"""Prompt caching across requests that keeps every output exact: a tree of prompt segments over KV cache entries.

A runtime that caches prompts prefills every prompt in passes along boundaries that the prompt's tokens alone decide,
cache or no cache (the llama.cpp runtime's: every 128th position and the start of each chat message). A segment's
entries, the tokens between two boundaries, then depend on the tokens up to its end alone, so a cached segment is
bit for bit what a cold prefill of any prompt cut the same way computes there, and a hit recomputes from the last
cached boundary in the very passes a cold prefill would run. Only segments that a prefill computed are cached (the
runtime's side of the rule): entries written by decoding or verify passes, an answer's tokens, came from passes of
other shapes, and the prompt that resends them prefills them again from the boundary before them.

The segments form a tree, a segment's parent the segment before it, shared by every request of a model; when the
cache outgrows its budget the least recently used leaf goes first. What a segment holds is the runtime's (bytes);
the tree only counts them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

DEFAULT_BUDGET_MB = 1024  # the server's --prompt-cache-mb and the generator's default: ~65,000 tokens of the default pair


class _Block:
    """A segment: the tokens that follow the tokens of its parent, and their KV cache entries."""

    __slots__ = ("tokens", "kv", "parent", "children", "used")

    def __init__(self, tokens: tuple[int, ...], kv: bytes, parent: _Block | None):
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[tuple[int, ...], _Block] = {}
        self.used = 0  # the cache's clock when a lookup or an insert last passed through it


@dataclass(frozen=True)
class PromptCacheStats:
    """What a prompt cache holds and what it saved, since it was made."""

    lookups: int  # prompts looked up
    hits: int  # of them, prompts that reused at least one segment
    tokens_reused: int  # prompt tokens taken from the cache instead of prefilled
    segments: int  # segments held now
    bytes: int  # bytes of KV cache entries held now
    budget_bytes: int
    evictions: int  # segments dropped to stay within the budget


class PromptCache:
    """Cached prompt segments of one or more models, within budget_bytes of KV cache entries (0: caches nothing).

    A prompt's segments are given as the positions where they end (`ends`, increasing; segment i holds the tokens
    from ends[i - 1], or 0, to ends[i]). They are kept per owner: a key the runtime makes for the model, the shape of
    the passes that computed them and how it cuts prompts (entries computed one way are never handed to a prefill
    that would compute them another way)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes (0 turns it off), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._roots: dict[Hashable, _Block] = {}  # owner -> a root holding no tokens
        self._clock = self._bytes = self._segments = 0
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

    def match(self, owner: Hashable, tokens: Sequence[int], ends: Sequence[int], most: int) -> list[bytes]:
        """The cached entries of the leading segments of `tokens`, at most `most` of them (a prefill needs the logits
        of its last token, so it leaves at least that token's segment to compute), in order; each is marked used."""
        with self._lock:
            self._lookups += 1
            node, found = self._roots.get(owner), []
            self._clock += 1
            most = min(most, len(ends))
            while node is not None and len(found) < most:
                i = len(found)
                node = node.children.get(tuple(tokens[ends[i - 1] if i else 0:ends[i]]))
                if node is not None:
                    node.used = self._clock
                    found.append(node.kv)
            if found:
                self._hits += 1
                self._reused += ends[len(found) - 1]
            return found

    def insert(self, owner: Hashable, tokens: Sequence[int], ends: Sequence[int], first: int, kvs: Sequence[bytes]
               ) -> int:
        """Cache segments first, first + 1, ... of `tokens` with their entries `kvs`; the segments before `first` are
        those match() found. -> how many were kept: segments that do not fit the budget, once every other least
        recently used leaf has gone, are not kept, and none whose earlier segments are gone."""
        if first + len(kvs) > len(ends) or any(b <= a for a, b in zip([0, *ends], ends)) or (
                ends and ends[-1] > len(tokens)):
            raise ValueError(f"segments {first}..{first + len(kvs) - 1} of a prompt of {len(tokens)} tokens are not "
                             f"all within its segments ending at {list(ends)[:8]}")
        if not self.enabled or not kvs:
            return 0
        starts = [0, *ends]
        with self._lock:
            self._clock += 1
            node = self._roots.setdefault(owner, _Block((), b"", None))
            for i in range(first):  # the segments that match() found
                node = node.children.get(tuple(tokens[starts[i]:ends[i]]))
                if node is None:
                    return 0
                node.used = self._clock
            kept = 0
            for i, kv in enumerate(kvs, start=first):
                key = tuple(tokens[starts[i]:ends[i]])
                child = node.children.get(key)
                if child is None:
                    if not self._make_room(len(kv), node):
                        break
                    child = node.children[key] = _Block(key, kv, node)
                    self._bytes += len(kv)
                    self._segments += 1
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
            self._segments -= 1
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
            self._bytes = self._segments = 0

    @property
    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(self._lookups, self._hits, self._reused, self._segments, self._bytes,
                                self.budget_bytes, self._evictions)
