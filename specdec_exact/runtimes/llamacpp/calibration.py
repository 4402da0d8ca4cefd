"""What is measured once per model file and machine, then cached: where prompts run faster in the prefill model, the
widest exact verify pass at each context length, and the shapes of a batch's fused passes that stay exact (the weight
layouts and the kernel plan, which also times the passes of each width, are measured in layouts.py and kernels.py).

Each result is cached in a JSON file keyed by the model file, the llama.cpp build, the CPU, the settings and the
kernel plan (so that what was measured under one plan is never read under another). One calibration runs at a time
on a machine (a file lock): timings taken while another process times its own kernels would measure the contention.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec_exact import progress
from specdec_exact.runtimes.llamacpp import kv_blocks
from specdec_exact.runtimes.llamacpp.context import SlotPool
from specdec_exact.runtimes.llamacpp.library import kernels_id

if TYPE_CHECKING:
    from specdec_exact.runtimes.llamacpp.model import LlamaCppModel
    from specdec_exact.runtimes.llamacpp.runner import LlamaCppRunner

DEFAULT_SLOT_TOKENS = 4096  # the slot size measure_batch_width checks (and a server's default context per sequence)


CALIBRATION_WIDTHS = range(2, 17)  # pass widths checked: up to 15 draft tokens, or 16 batched sequences
# Cached tokens before the checked passes: short; past the 512 cells where ggml's attention changes strategy for f16
# caches; and a long context (prompts of a few pages). Beyond the longest, the engine verifies one token at a time.
CALIBRATION_CONTEXTS = (16, 600, 4096)
CALIBRATION_VERSION = 9  # bump when what is measured changes: older cached results are then measured again
CALIBRATIONS = {  # kind -> what it measures, as progress names it
    "layouts": "which weight layout runs faster",
    "kernel-plan": "which kernels take each pass width",
    "prefill-split": "where prompts run faster in the other weight layout",
    "batch-shapes": "which verify and batched passes stay exact",
    "step": "what a one-token pass costs",
}


def step_settings(threads: int, kv_cache: str) -> str:
    """The settings a model's step time is cached under (LlamaCppModel.quick_step_s), known before it is loaded: a
    model whose weight layout is chosen at load (repack="auto") chooses the same one for these again."""
    return f"threads={threads}|kv_cache={kv_cache}|layout=auto|fastest kernel"  # (before: llama.cpp's own kernel)


# What is a property of the weights, the library build and the CPU, not of the timings: whether passes stay exact
# beyond the kernel plan's short context (the attention path over longer caches, batches of sequences). The thread
# count and the kernel plan change neither: every output element of a matrix product is one dot product over the whole
# row whatever the threads, the multi-column kernels give each column llama.cpp's own one-column result (which
# measure_kernel_plan checks, per width, for the plan in force: LlamaCppModel.plan_exact_width caps these), and the
# plan touches no attention. So they are measured once per model file, build, CPU, cache type and weight layout, and a
# new --threads value or plan does not measure them again.
EXACTNESS_KINDS = ("batch-shapes", "pass-merging", "slot-merging")


def cached(model: LlamaCppModel, kind: str, measure) -> dict:
    """measure(model), cached per model file, llama.cpp build, CPU, cache type and weight layouts, and, for the
    timings, per thread count and kernel plan (so that what was timed under one plan is never read under another)."""
    plan = model.kernel_plan
    describe = {"threads": model.threads, "kv_cache": model.kv_setting, "repack": model.repack,
                "kernel_plan": plan.describe()}
    if kind in EXACTNESS_KINDS:
        return cached_json(model.path, kind, f"{model.kv_setting}|{model.repack}", lambda: measure(model), describe)
    return cached_json(model.path, kind, f"{model.threads}|{model.kv_setting}|{model.repack}|{plan.key}",
                       lambda: measure(model), describe)


def _cache_file(path: Path, kind: str, settings: str) -> Path:
    """Where a calibration of a GGUF file (path, size, mtime) is cached, per llama.cpp build, CPU flags and settings."""
    import hashlib
    from importlib.metadata import version

    from specdec_exact.runtimes.llamacpp.kernels import multi_column_kernels

    stat = path.stat()
    cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "") if os.path.exists(
        "/proc/cpuinfo") else os.uname().machine
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('llama_cpp_python')}|"
                         f"{kernels_id()}|{multi_column_kernels()}|{cpu}|{settings}|{CALIBRATION_VERSION}".encode()
                         ).hexdigest()[:24]
    return calibration_folder() / f"{path.stem}-{kind}-{key}.json"


def peek_json(path: Path, kind: str, settings: str) -> dict | None:
    """What cached_json cached for these arguments, measuring nothing (None where nothing was cached)."""
    import json

    try:
        return json.loads(_cache_file(path, kind, settings).read_text())["measured"]
    except (OSError, ValueError, KeyError):
        return None


def cached_json(path: Path, kind: str, settings: str, measure, describe: dict) -> dict:
    """measure(), cached in a JSON file per GGUF file (path, size, mtime), llama.cpp build, CPU flags and settings."""
    cached = _cache_file(path, kind, settings)
    found = peek_json(path, kind, settings)
    if found is not None:
        return found
    cached.parent.mkdir(parents=True, exist_ok=True)
    with _calibrating(cached.parent):
        found = peek_json(path, kind, settings)  # another process may have measured it while this one waited
        if found is None:
            # (a calibration that another one needs runs on that one's thread)
            with progress.step(f"calibrating {path.name}: {CALIBRATIONS.get(kind, kind)} (once on this machine)"):
                found = measure() if _calibration_depth > 1 else on_a_thread_of_its_own(measure)
            store_json(path, kind, settings, found, describe)
    return found


def store_json(path: Path, kind: str, settings: str, measured: dict, describe: dict) -> None:
    """Cache `measured` where cached_json and peek_json look for it (replacing what was there)."""
    import json

    cached = _cache_file(path, kind, settings)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"model": str(path), **describe, "measured": measured}) + "\n")
    partial.replace(cached)


def calibration_folder() -> Path:
    """Where the calibrations are cached (deleting it measures everything again at the next load)."""
    from specdec_exact import registry

    return registry.cache_root() / "calibration"


def on_a_thread_of_its_own(work):
    """work() on a new thread that ends when it returns -> what it returned (what it raised is raised here).

    llama.cpp's CPU backend runs a pass on OpenMP threads, and libgomp (one copy in the process, shared with torch)
    keeps a pool of worker threads for each thread that started a parallel region, for as long as that thread lives.
    Once it manages more threads than there are CPUs, it stops spinning at its barriers and puts every thread to sleep
    at each one. A server calibrates on its main thread and decodes on its model thread: on an AMD EPYC Zen 4 (2 cores)
    a server that had just calibrated ran at 0.78x of --draft none's tokens/s until restarted (BENCHMARKS.md,
    docs/calibration-thread-zen4). A calibration on a thread of its own takes its pool with it when it ends."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # (an interrupt too: it is raised in the caller)
            outcome["error"] = error

    thread = threading.Thread(target=run, name="specdec-calibration", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


_calibration_depth = 0  # calibrations in progress in this process (one measures what it needs of another)


@contextlib.contextmanager
def _calibrating(folder: Path):
    """One calibration at a time on this machine: timings taken while another process times its own kernels (two
    servers started at once) measure the contention, and the cache would keep them. A process waits for the lock
    (saying so on a terminal), then reads what the other one measured if it was the same."""
    global _calibration_depth
    if _calibration_depth:  # this process holds the lock already
        _calibration_depth += 1
        try:
            yield
        finally:
            _calibration_depth -= 1
        return
    import fcntl

    with open(folder / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with progress.step("another process is calibrating on this machine: waiting for it"):
                fcntl.flock(lock, fcntl.LOCK_EX)
        _calibration_depth = 1
        try:
            yield
        finally:
            _calibration_depth = 0
            fcntl.flock(lock, fcntl.LOCK_UN)


def probe_tokens(model: LlamaCppModel, n: int) -> torch.Tensor:
    return torch.arange(n)[None] * 7919 % model.n_vocab  # [1, n] any in-vocabulary tokens


def time_one_token_passes(model: LlamaCppModel, runner: LlamaCppRunner, tokens: torch.Tensor, times: dict) -> None:
    """One round of one-token passes: tokens [1, n + 1], the first n in the runner's cache, the last fed under each
    kernel of `times` in turn (the model's plan set to it: the caller restores its own), that pass's seconds appended
    to the kernel's list."""
    import time

    from specdec_exact.runtimes.llamacpp.kernels import KernelPlan

    prefix = tokens.shape[1] - 1
    for kernel, seconds in times.items():
        model._kernel_plan = KernelPlan.uniform(kernel)
        runner.rollback(prefix)
        started = time.perf_counter()
        runner.forward(tokens[:, prefix:])
        seconds.append(time.perf_counter() - started)


def one_token_logits(runner: LlamaCppRunner, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of tokens [1, n] fed one pass each -> [n, vocab]."""
    return torch.cat([runner.forward(tokens[:, i:i + 1])[0] for i in range(tokens.shape[1])])


def private_runner(model: LlamaCppModel, tokens: int) -> LlamaCppRunner:
    """A sequence in a context of its own (freed with the runner), leaving the model's pools alone: the calibration
    may run while a sequence is being generated."""
    return SlotPool(model, 1, tokens).take(model.n_vocab)


PREFILL_SPLIT_SIZES = (32, 64, 128)  # prompt segments timed in each model: from above the kernel plan's widths to a block


def measure_prefill_split(model: LlamaCppModel, sizes=PREFILL_SPLIT_SIZES, repeats: int = 3) -> dict:
    """Seconds of a prompt segment of each size after 16 cached tokens, in one pass of the model's prefill model and
    here in passes of MAX_WIDTH tokens under the kernel plan, interleaved, medians of `repeats`, the sizes in turn up to
    the first at which the prefill model is faster -> {"seconds": {size: {"here", "prefill_model"}}, "min_tokens": the size from which the prefill model is faster (interpolated between
    the sizes; beyond a block, PREFILL_BLOCK + 1: never)}. Moving the sequence's cache to the prefill model's context
    and back is not counted, which favours the prefill model by that much."""
    import statistics
    import time

    from specdec_exact.runtimes.llamacpp.context import BATCH, Context, evaluate
    from specdec_exact.runtimes.llamacpp.kernels import MAX_WIDTH

    prefix, there = CALIBRATION_CONTEXTS[0], model.prefill_model
    tokens = probe_tokens(model, prefix + max(sizes))[0].tolist()
    contexts = {"here": (model, Context(model, len(tokens))), "prefill_model": (there, Context(there, len(tokens)))}
    widths = {"here": MAX_WIDTH, "prefill_model": BATCH}

    def seconds(where: str, n: int) -> float:
        evaluating, context = contexts[where]
        context.remove(0, prefix)
        started = time.perf_counter()
        for begin in range(prefix, prefix + n, widths[where]):
            end = min(prefix + n, begin + widths[where])
            evaluate(evaluating, context, [(0, i, tokens[i], i == end - 1) for i in range(begin, end)])
        return time.perf_counter() - started

    try:
        for where, (evaluating, context) in contexts.items():
            evaluate(evaluating, context, [(0, i, tokens[i], i == prefix - 1) for i in range(prefix)])
            seconds(where, MAX_WIDTH)  # a first pass warms the caches
        medians = {}
        for n in sizes:  # up to the first size at which the prefill model is faster
            times = {where: [] for where in contexts}
            for _ in range(repeats):
                for where in contexts:
                    times[where].append(seconds(where, n))
            medians[n] = {where: statistics.median(t) for where, t in times.items()}
            if medians[n]["prefill_model"] < medians[n]["here"]:
                break
    finally:
        for _, context in contexts.values():
            context.free()
    return {"seconds": {str(n): by for n, by in medians.items()}, "min_tokens": split_size(medians)}


def two_blocks_after_a_prefix(model: LlamaCppModel):
    """What the prompt-pass calibrations pass over: 2 x PREFILL_BLOCK probe tokens after CALIBRATION_CONTEXTS[0]
    cached -> (that prefix's length, all the tokens, a context of their length holding the prefix). Free the context
    when done."""
    from specdec_exact.runtimes.llamacpp.context import PREFILL_BLOCK, Context, evaluate

    prefix = CALIBRATION_CONTEXTS[0]
    tokens = probe_tokens(model, prefix + 2 * PREFILL_BLOCK)[0].tolist()
    context = Context(model, len(tokens))
    try:
        evaluate(model, context, [(0, i, tokens[i], False) for i in range(prefix)])
    except BaseException:
        context.free()
        raise
    return prefix, tokens, context


def measure_tiled_columns(model: LlamaCppModel, repeats: int = 3) -> dict:
    """Seconds of a pass over two prompt blocks (2 x PREFILL_BLOCK tokens after 16 cached) with ggml's tiled kernels keeping whole
    column windows and cutting them as released (kernels.apply_tiled_whole_columns), interleaved, medians of
    `repeats` -> {"seconds": {"whole", "as_released"}, "whole_columns": whether whole windows were faster}. The two
    give the same results bit for bit, so this chooses a speed, never an output."""
    import statistics
    import time

    from specdec_exact.runtimes.llamacpp.context import evaluate

    prefix, tokens, context = two_blocks_after_a_prefix(model)  # (two blocks: what a merged pass holds)

    def seconds(whole: bool) -> float:
        model._whole_columns = whole  # (what evaluate applies to the pass)
        context.remove(0, prefix)
        started = time.perf_counter()
        evaluate(model, context, [(0, i, tokens[i], i == len(tokens) - 1) for i in range(prefix, len(tokens))])
        return time.perf_counter() - started

    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        seconds(True)  # a first pass warms the caches
        for _ in range(repeats):
            for whole in (False, True):
                times[whole].append(seconds(whole))
    finally:
        model._whole_columns = None
        context.free()
    medians = {whole: statistics.median(t) for whole, t in times.items()}
    return {"seconds": {"whole": medians[True], "as_released": medians[False]},
            "whole_columns": medians[True] < medians[False]}


MERGE_CANDIDATES = (64, 128)  # the pass sizes from which merging is tried, smallest first (64: ggml's attention tile)


def measure_pass_merging(model: LlamaCppModel, candidates=MERGE_CANDIDATES) -> dict:
    """Whether passes of at least m tokens give every token the same logits bit for bit however a prompt is cut into
    them: 2 x PREFILL_BLOCK tokens after 16 cached, every row's logits, in one pass (whole tiled column windows) and
    in passes of m tokens and in two uneven ones (m + 37 and the rest, windows cut as released), for each candidate m
    in turn -> {"merge_from": the first m that passed (None: none did, every segment keeps a pass of its own),
    "checked": {m: whether it passed}}. A pass of fewer tokens takes other kernels on some paths (ggml's attention
    sweeps up to 63 query rows one by one and tiles 64 or more), which is why no merging is tried below 64."""
    import numpy as np

    from specdec_exact.runtimes.llamacpp.context import evaluate

    prefix, tokens, context = two_blocks_after_a_prefix(model)

    def logits(cuts: list[int], whole: bool) -> np.ndarray:
        model._whole_columns = whole
        context.remove(0, prefix)
        bounds = [prefix, *cuts, len(tokens)]
        return np.concatenate([evaluate(model, context, [(0, i, tokens[i], True) for i in range(begin, end)])
                               for begin, end in zip(bounds, bounds[1:])])

    checked: dict[str, bool] = {}
    saved = model._whole_columns
    try:
        one = logits([], True)
        for m in candidates:
            even = list(range(prefix + m, len(tokens) - m + 1, m))
            checked[str(m)] = all(np.array_equal(one, logits(cuts, False)) for cuts in (even, [prefix + m + 37]))
            if checked[str(m)]:
                break
    finally:
        model._whole_columns = saved
        context.free()
    return {"merge_from": next((int(m) for m, same in checked.items() if same), None), "checked": checked}


def measure_slot_merging(model: LlamaCppModel, slots: int = max(CALIBRATION_WIDTHS)) -> dict:
    """Whether a prompt read by a sequence alone in a pool of several, its long segments sharing passes as a lone
    request's do (LlamaCppRunner._run), gives the last token's logits and the cache (every layer's keys and values) of
    the same prompt read in a pool of one a pass per segment -> {"exact": whether it did, "passes": the passes each
    took}. The slot is not the first one, and every slot held a sequence before: a server's slots are reused."""
    from specdec_exact.runtimes.llamacpp.context import PREFILL_BLOCK

    tokens = probe_tokens(model, 3 * PREFILL_BLOCK + 42)[:, 1:]  # three blocks and a short one
    length = tokens.shape[1]
    reference = private_runner(model, length)
    reference.merges = False
    try:
        expected = reference.forward(tokens, last_only=True)
        cache = cache_rows(reference.pool.context.save_state(reference.seq), length)
        passes = {"one per segment": reference.prefill_passes}
    finally:
        reference.close()
    slots_pool = SlotPool(model, slots, length)
    try:
        for runner in [slots_pool.take(model.n_vocab) for _ in range(slots)]:
            runner.forward(tokens[:, :40])
            runner.close()
        first, runner = slots_pool.take(model.n_vocab), slots_pool.take(model.n_vocab)
        first.close()  # (the runner in the second slot is alone now)
        runner.merges = True
        got = runner.forward(tokens, last_only=True)
        passes["merged in a slot"] = runner.prefill_passes
        exact = (cache is not None and torch.equal(got, expected)
                 and cache_rows(slots_pool.context.save_state(runner.seq), length) == cache)
        runner.close()
    finally:
        slots_pool.close()
    return {"exact": bool(exact), "passes": passes}


def split_size(medians: dict[int, dict[str, float]]) -> int:
    """From seconds per segment size ({size: {"here", "prefill_model"}}, sizes increasing) -> the size from which the
    prefill model is faster: between the last size where it is slower and the first where it is faster, linearly; at
    least PREFILL_MIN_TOKENS (one pass here up to the kernel plan's widths); PREFILL_BLOCK + 1 (never) if it never is."""
    from specdec_exact.runtimes.llamacpp.context import PREFILL_BLOCK
    from specdec_exact.runtimes.llamacpp.runner import PREFILL_MIN_TOKENS

    previous = None  # (size, lead) of the last size where here was faster
    for n in sorted(medians):
        lead = medians[n]["here"] - medians[n]["prefill_model"]
        if lead > 0:
            if previous is None:
                return PREFILL_MIN_TOKENS
            size, behind = previous
            return max(PREFILL_MIN_TOKENS, int(size + (n - size) * -behind / (lead - behind)) + 1)
        previous = (n, lead)
    return PREFILL_BLOCK + 1


def measure_exact_widths(model: LlamaCppModel, widths=CALIBRATION_WIDTHS, contexts=CALIBRATION_CONTEXTS) -> dict:
    """At each context length (capped by the model's), evaluate the same tokens one at a time and in passes of each
    width in widths -> {"exact_width": {length: the largest w such that every pass of 2..w tokens gives the one-token logits
    bit for bit (1 if none does)}}. The long context costs a prefill of that many tokens, once per machine."""
    found = {}
    lengths = sorted({min(n, model.max_length - max(widths)) for n in contexts})
    for length in progress.each(lengths, "verify passes against one-token passes after N tokens", "context"):
        tokens = probe_tokens(model, length + max(widths))
        runner = private_runner(model, tokens.shape[1])
        runner.forward(tokens[:, :length], last_only=True)
        found[str(length)] = widest_exact(runner, length, tokens[:, length:],
                                          one_token_logits(runner, tokens[:, length:]), widths)
    return {"exact_width": found}


def widest_exact(runner: LlamaCppRunner, length: int, tokens: torch.Tensor, single: torch.Tensor, widths) -> int:
    """The largest w in widths such that passes over the first 2..w of tokens [1, n], each right after the runner's
    first `length` tokens, give single's rows (their one-token passes' logits, [n, vocab]) bit for bit (1 if none
    does). The runner is left at `length`."""
    exact = 1
    for width in widths:
        runner.rollback(length)
        if exact == width - 1 and torch.equal(runner.forward(tokens[:, :width])[0], single[:width]):
            exact = width
    runner.rollback(length)
    return exact


def measure_batch_width(model: LlamaCppModel, widths=CALIBRATION_WIDTHS, contexts=CALIBRATION_CONTEXTS,
                        slot_tokens: int = DEFAULT_SLOT_TOKENS) -> dict:
    """The shapes a batch's passes take, each against its sequences' own one-token passes in a context of their own.

    A batch context holds max(widths) sequences of different lengths (each calibrated context length, capped by the
    slot size), in slots that held another sequence before. Each prompt is prefilled in its slot beside the others
    and must give the logits and cache of a prompt prefilled alone. Then, for each w in widths, the fused passes a
    scheduler makes of w tokens: one token from each of w sequences (consecutive sequence ids, and ids with gaps
    where slots were freed), a ragged mix (one sequence with w - 1 tokens beside one with 1), an uneven spread, and
    one sequence alone verifying w tokens in its slot. -> {"batch_width": the largest w such that every pass of
    2..w tokens gave every token its one-token logits bit for bit (1 if none did), "alone_width": the same for the
    passes of one sequence alone in its slot (a seeded sample verifies as it would alone, which may be wider than a
    shared pass), "prefill_in_slot_exact": whether prompts prefilled in slots left the logits and the cache (every
    layer's keys and values) of prompts prefilled alone, "exact_width": {length: the widest verify pass of one
    sequence in a context of its own found exact there (measure_exact_widths's check, on the prompts prefilled alone
    here, which saves it long prefills of its own)}, "contexts": the lengths checked}."""
    n = max(widths)
    longest = min(slot_tokens, model.max_length) - n
    lengths = sorted({min(length, longest) for length in contexts})
    prefix_of = [lengths[i % len(lengths)] for i in range(n)]  # slot i's context length
    mixes = {width: batch_mixes(width, n) for width in widths}
    needed = [max(count for width_mixes in mixes.values() for mix in width_mixes for slot, count in mix if slot == i)
              for i in range(n)]  # the most tokens a pass takes from slot i: its one-token passes to compare with
    continuations = [probe_tokens(model, n * (i + 2))[:, -needed[i]:] for i in range(n)]  # all different
    prompts = {length: probe_tokens(model, length + 1)[:, 1:] for length in lengths}  # [1, length]
    alone_prefill, alone_cache, alone, exact_width = {}, {}, [None] * n, {}
    # each prompt alone, then each of its slots' continuations one at a time, and its verify passes
    for length, prompt in progress.each(prompts.items(), "prompts prefilled alone", "prompt"):
        runner = private_runner(model, length + n)
        alone_prefill[length] = runner.forward(prompt, last_only=True)
        alone_cache[length] = cache_rows(runner.pool.context.save_state(runner.seq), length)
        for i in (i for i in range(n) if prefix_of[i] == length):
            runner.rollback(length)
            alone[i] = one_token_logits(runner, continuations[i])
        full = next((i for i in range(n) if prefix_of[i] == length and needed[i] == n), None)  # max(widths) tokens
        check = continuations[full] if full is not None else probe_tokens(model, length + n + 1)[:, -n:]
        runner.rollback(length)
        single = alone[full] if full is not None else one_token_logits(runner, check)
        exact_width[str(length)] = widest_exact(runner, length, check, single, widths)
    slots = SlotPool(model, n, longest + n)
    earlier = [slots.take(model.n_vocab) for _ in range(n)]
    for runner in earlier:  # every slot held a sequence before: a server's slots are reused
        runner.forward(prompts[lengths[-1]][:, :40])
        runner.close()
    runners = [slots.take(model.n_vocab) for _ in range(n)]
    prefill_exact, states = True, {}
    for i, runner in progress.each(enumerate(runners), "the same prompts prefilled in batch slots", "slot"):
        length = prefix_of[i]
        if length in states:  # a copy of the slot prefilled before: equal contents, at no second prefill's cost
            slots.context.load_state(states[length], runner.seq)
            runner.advance(prompts[length][0].tolist())
        else:
            prefill_exact &= torch.equal(runner.forward(prompts[length], last_only=True), alone_prefill[length])
            states[length] = slots.context.save_state(runner.seq)
            cache = cache_rows(states[length], length)
            prefill_exact &= cache is not None and cache == alone_cache[length]
    widest = alone_widest = 1  # of every shape; of one sequence alone
    for width in progress.each(widths, "batched passes of each width", "width"):
        shared = by_itself = True
        for mix in mixes[width]:
            if len(mix) > 1 and widest < width - 1:  # shared passes stopped being exact at a narrower width
                continue
            items = [(runners[i], continuations[i][:, :count]) for i, count in mix]
            outputs = slots.forward_many(items) if len(items) > 1 else [items[0][0].forward(items[0][1])]
            exact = True
            for (i, count), logits in zip(mix, outputs):
                exact &= torch.equal(logits[0], alone[i][:count])
                runners[i].rollback(prefix_of[i])
            if len(items) > 1:
                shared &= exact
            else:
                by_itself &= exact
        alone_widest = width if by_itself and alone_widest == width - 1 else alone_widest
        widest = width if shared and by_itself and widest == width - 1 else widest
        if alone_widest < width:
            break
    for runner in runners:
        runner.close()
    slots.close()
    return {"batch_width": widest, "alone_width": alone_widest, "prefill_in_slot_exact": bool(prefill_exact),
            "exact_width": exact_width, "contexts": lengths}


def cache_rows(state: bytes, length: int) -> list[bytes] | None:
    """Every layer's keys and values of positions 0..length-1 in a sequence state (llama_state_seq_get_data's bytes)
    -> comparable across contexts (the state's header names its sequence and its context's streams), or None where
    the state is not laid out as kv_blocks reads it."""
    found = kv_blocks.split(state, [(0, length)])
    return None if found is None else [bytes(rows) for rows in found[1]]


def batch_mixes(width: int, slots: int) -> list[list[tuple[int, int]]]:
    """The fused passes of `width` tokens that a batch over `slots` sequences can make, as (slot, tokens) lists:
    one token from each of `width` sequences with consecutive ids and with gaps between ids, one sequence with
    width - 1 tokens beside one with 1, tokens spread unevenly (3, 1, 2, 3, 1, 2, ...), and one sequence alone."""
    spaced = [*range(0, slots, 2), *range(1, slots, 2)]
    spread, total, i = [], 0, 0
    while total < width:
        count = min((3, 1, 2)[i % 3], width - total)
        spread.append((i % slots, count))
        total, i = total + count, i + 1
    alone = [[(slot, width)] for slot in range(min(3, slots))]  # a batch of one, at each context length
    return [[(i, 1) for i in range(width)], [(spaced[i], 1) for i in range(width)],
            [(min(2, slots - 1), width - 1), (0, 1)], spread, *alone]


