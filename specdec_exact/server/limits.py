"""What the server holds at once: the tokens one request may hold (--ctx-size) and the requests decoded together
(--max-batch), decided from the KV caches a full batch needs against the memory available, before any is allocated.

A batch of max_batch requests of ctx_size tokens each needs generator.kv_bytes_per_token() * ctx_size * max_batch
bytes of KV cache when every request is full (llama.cpp allocates it all up front; torch's caches grow to it). The
prompt cache takes its budget besides, and a prefill through it copies a sequence's KV state (PREFILL_COPIES).
"""

from __future__ import annotations

from pathlib import Path

# The share of MemAvailable the KV caches of a full batch may take. A quarter, because MemAvailable counts the page
# cache as free, and that is where llama.cpp's memory-mapped weights live (evicting them makes each pass read the
# weights from disk); because a fused pass's activations, the runtime's compute buffers, Python and the tokenizer
# need room besides the caches; and because other processes on the machine may grow after the server starts.
MEMORY_SHARE = 0.25
CTX_STEP = 256  # the default context is a multiple of this many tokens
# The default context never goes below this (or below the trained context, where that is shorter): a system prompt,
# a question and an answer of a few hundred tokens fit; where memory cannot give every request that much, fewer
# requests at once (--max-batch) serve better than contexts too short to use.
MIN_CTX_SIZE = 1024
# A prefill through the prompt cache holds up to this many copies of one sequence's KV state besides the sequence
# itself: the state read out of the context, its segments cut from it, and a joined state loaded back.
PREFILL_COPIES = 3


def available_memory(meminfo: Path | str = "/proc/meminfo") -> int | None:
    """Bytes the kernel can give new allocations without swapping (MemAvailable); None where it does not say (not
    Linux), and then no limit is derived from memory."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # in kB
    return None


def choose_ctx_size(requested: int | None, *, kv_bytes_per_token: int, trained_context: int, max_batch: int,
                    available_bytes: int | None, prompt_cache_bytes: int = 0) -> int:
    """The tokens one request may hold, prompt and completion together -> ctx_size.

    requested None (the default): the largest multiple of CTX_STEP tokens, at most the trained context, such that
    max_batch requests' KV caches fit in MEMORY_SHARE of available_bytes; the trained context where memory is
    unknown. prompt_cache_bytes: the prompt cache's budget (0: none), which the share holds besides the caches, with
    PREFILL_COPIES more sequences' KV for the copies a prefill through it makes. An explicit --ctx-size is kept when it fits. Raises ValueError, saying what to change, for a
    --ctx-size beyond the trained context or the memory, and for a --max-batch whose caches do not fit even at
    MIN_CTX_SIZE tokens (or at the --ctx-size given).
    """
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    if requested is not None and requested < 2:
        raise ValueError(f"--ctx-size must be at least 2 tokens (a prompt token and a new one), got {requested}")
    if requested is not None and requested > trained_context:
        raise ValueError(f"--ctx-size {requested} exceeds the target's trained context of {trained_context} tokens: "
                         f"use --ctx-size {trained_context} or less")
    if available_bytes is None or kv_bytes_per_token <= 0:
        return trained_context if requested is None else requested
    copies = PREFILL_COPIES if prompt_cache_bytes else 0
    budget = int(available_bytes * MEMORY_SHARE)
    left = max(0, budget - prompt_cache_bytes)  # for the KV caches
    fits = left // (kv_bytes_per_token * (max_batch + copies))  # tokens per request that the caches leave
    share = f"{MEMORY_SHARE:.0%} of the available memory ({_size(budget)} of {_size(available_bytes)})"
    if prompt_cache_bytes:
        share += (f" less the prompt cache's {_size(prompt_cache_bytes)} (--prompt-cache-mb) and the {copies} "
                  "copies of a sequence that a prefill through it makes")
    if requested is not None:
        if requested <= fits:
            return requested
        need = kv_bytes_per_token * requested * max_batch
        if fits >= 2:
            raise ValueError(f"--ctx-size {requested} with --max-batch {max_batch}: {max_batch} requests of "
                             f"{requested} tokens need {_size(need)} of KV cache, more than {share}: use --ctx-size "
                             f"{fits} or less, or a smaller --max-batch")
        raise ValueError(_too_many(max_batch, requested, kv_bytes_per_token, left, share, copies))
    ctx = min(trained_context, fits // CTX_STEP * CTX_STEP)
    if ctx >= min(MIN_CTX_SIZE, trained_context):
        return ctx
    raise ValueError(_too_many(max_batch, min(MIN_CTX_SIZE, trained_context), kv_bytes_per_token, left, share,
                               copies))


def _too_many(max_batch: int, tokens: int, kv_bytes_per_token: int, left: int, share: str, copies: int) -> str:
    """Why max_batch requests of `tokens` tokens do not fit in `left` bytes, and how many would."""
    most = left // (kv_bytes_per_token * tokens) - copies
    advice = f"use --max-batch {most} or less, or a smaller --ctx-size" if most >= 1 else "use a smaller --ctx-size"
    if copies:
        advice += " or --prompt-cache-mb"
    return (f"--max-batch {max_batch}: {max_batch} requests of {tokens} tokens need "
            f"{_size(kv_bytes_per_token * tokens * max_batch)} of KV cache ({kv_bytes_per_token} bytes a token), "
            f"more than {share}: {advice}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
