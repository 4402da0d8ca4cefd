"""A GGUF model loaded by llama.cpp: its weights, what was calibrated for it on this machine, and its slot pools."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch

from specdec_exact.prompt_cache import PromptCache
from specdec_exact.runtimes.base import PassCosts
from specdec_exact.runtimes.llamacpp import calibration, kv_blocks
from specdec_exact.runtimes.llamacpp.context import (DEFAULT_KV_CACHE, INITIAL_CONTEXT, KV_CACHE_BYTES, KV_CACHE_TYPES,
                                                     RELEASE_WAIT_S, Context, SlotPool)
from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP as LLAMA_CPP_KERNELS
from specdec_exact.runtimes.llamacpp.kernels import ONE_TOKEN_REPEATS, KernelPlan
from specdec_exact.runtimes.llamacpp.layouts import choose_layouts
from specdec_exact.runtimes.llamacpp.library import default_threads, library, recent_problems

log = logging.getLogger("specdec.llamacpp")


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp: weights memory-mapped, shared by every sequence of every pool.

    repack: llama.cpp's weight layouts repacked for the CPU, or plain; "auto" keeps the one whose one-token passes
    were faster on this CPU (layouts.choose_layouts: which wins differs between CPUs, and the repacked layouts crashed
    llama.cpp on one). prefill_repack: prompts in the other layout where that was measured faster for them ("auto"),
    a layout, or None (prompts in the model's own); the prompt's KV cache is then copied into the sequence's slot.
    prefill_min_tokens: the shortest prompt segment that runs in the prefill layout ("auto": where that was measured
    faster than passes of up to 16 tokens here, calibration.measure_prefill_split).
    attention_split: one-token passes over an f16 cache of 512+ cells split attention across threads, as llama.cpp
    does as released; verify passes then cannot reproduce them there (the calibration narrows verification to one
    token). Off by default: every pass sweeps each row in one pass (context.KV_CACHE_TYPES).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None, kv_cache: str = DEFAULT_KV_CACHE,
                 repack: bool | str = "auto", prefill_repack: bool | str | None = "auto",
                 attention_split: bool = False, prefill_min_tokens: int | str = "auto"):
        lib = library()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache!r}")
        self.kv_cache = kv_cache
        self.attention_split = attention_split
        if prefill_min_tokens != "auto" and not (isinstance(prefill_min_tokens, int) and prefill_min_tokens >= 1):
            raise ValueError(f"prefill_min_tokens must be 'auto' or a number of tokens >= 1, got {prefill_min_tokens!r}")
        self._prefill_min_tokens = prefill_min_tokens
        if repack not in (True, False, "auto"):
            raise ValueError(f"repack must be True, False or 'auto', got {repack!r}")
        if prefill_repack not in (True, False, None, "auto"):
            raise ValueError(f"prefill_repack must be True, False, None or 'auto', got {prefill_repack!r}")
        layouts = choose_layouts(self.path, self.threads) if repack == "auto" else {}
        # (quick_step_s: a step is cached per machine where nothing but the thread count and cache type sets it)
        self._layout_chosen = repack == "auto" and not attention_split
        self.repack = layouts.get("repack", repack)
        if prefill_repack == "auto":
            prefill_repack = layouts.get("prefill_repack", self.repack)
            prefill_repack = None if prefill_repack == self.repack else prefill_repack
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = self.repack
        recent_problems()
        self.handle = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.handle:
            said = recent_problems()
            raise ValueError(f"llama.cpp could not load {self.path}: not a GGUF language model it supports"
                             + (f" (llama.cpp said: {said})" if said else ""))
        self._pools: dict[str, SlotPool] = {}  # "solo" (a pool of one, growing), "batch"; freed before the weights
        self._prefill_context: list[Context | None] = [None]
        weakref.finalize(self, _free_model, lib, self.handle, self._pools, self._prefill_context)
        if lib.llama_model_is_recurrent(self.handle) or lib.llama_model_is_hybrid(self.handle):
            raise ValueError(f"{self.path.name} has recurrent layers, whose state cannot be rolled back; "
                             "speculative decoding needs full attention in every layer")
        vocab = lib.llama_model_get_vocab(self.handle)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.max_length = lib.llama_model_n_ctx_train(self.handle)
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, i))
        # Control tokens that do not end a generation, such as ChatML's <|im_start|>, begin a chat's messages: prompts
        # are prefilled in passes cut before them (context.prefill_bounds), so a conversation's messages are cached
        self.segment_marks = frozenset(i for i in range(self.n_vocab)
                                       if lib.llama_vocab_is_control(vocab, i) and i not in self.eos_ids)
        # What a chat template writes before the assistant's reply, and after it (ChatML: "<|im_start|>assistant\n",
        # "<|im_end|>\n"), where the generator that runs this model as its target knows them: prompts cut an
        # answer's segments to be prefilled as decoding computed them (context.PREFILL_BLOCK). None: no answers.
        self.answer_start: tuple[int, ...] | None = None
        self.answer_end: tuple[int, ...] | None = None
        n_head = lib.llama_model_n_head(self.handle)
        head_dim = lib.llama_model_n_embd(self.handle) // max(1, n_head)
        # keys and values of every layer's KV heads
        self.kv_bytes_per_token = int(2 * lib.llama_model_n_layer(self.handle) * lib.llama_model_n_head_kv(
            self.handle) * head_dim * KV_CACHE_BYTES[kv_cache])
        self._measured: dict[str, dict] = {}
        self._self_test_failed = False  # (self_test): then every pass the engine verifies holds one token
        self._self_tested = False  # prepare_as_target runs the self-test once per load, however many generators
        self._kernel_plan: KernelPlan | None = None
        self._whole_columns: bool | None = None  # (tiled_whole_columns: measured by prepare)
        self._exact_widths: tuple[tuple, dict[int, int]] | None = None  # (exact_widths: what it was computed from)
        # How its sequence states lay out their rows, for the prompt cache's blocks (kv_blocks.split learns it)
        self.kv_format: kv_blocks.StateFormat | None = None
        self.prefill_model = None if prefill_repack is None else LlamaCppModel(
            self.path, self.threads, kv_cache, repack=prefill_repack, prefill_repack=None,
            attention_split=attention_split)
        if self.prefill_model is not None:  # its passes are prompts (a last piece of one can be short): as released
            self.prefill_model._kernel_plan = KernelPlan.uniform(LLAMA_CPP_KERNELS)

    @property
    def kv_setting(self) -> str:
        """The cache type, and whether one-token passes split attention, as calibrations are keyed."""
        return f"{self.kv_cache}, attention split" if self.attention_split else self.kv_cache

    # ---- calibrations (each measured once per model file and machine, then cached: specdec_exact.runtimes.llamacpp.calibration)

    def _calibrated(self, kind: str, measure) -> dict:
        if kind not in self._measured:
            self._measured[kind] = calibration.cached(self, kind, measure)
        return self._measured[kind]

    @property
    def kernel_calibration(self) -> dict:
        """What kernels.measure_kernel_plan found: every candidate's time and exactness per width, and the plan."""
        if "kernel-plan" not in self._measured:
            from specdec_exact.runtimes.llamacpp.kernels import measure_kernel_plan

            self._measured["kernel-plan"] = calibration.cached_json(  # (re-timed where width 1 had fewer rounds)
                self.path, "kernel-plan",
                f"{self.threads}|{self.kv_setting}|{self.repack}|one-token rounds {ONE_TOKEN_REPEATS}",
                lambda: measure_kernel_plan(self),
                {"threads": self.threads, "kv_cache": self.kv_setting, "repack": self.repack})
        return self._measured["kernel-plan"]

    @property
    def kernel_plan(self) -> KernelPlan:
        """Which kernels take this model's passes of each width 1-16 (wider ones take llama.cpp's own): the fastest
        exact ones on this machine. Set in the library before each of the model's passes."""
        if self._kernel_plan is None:
            self._kernel_plan = KernelPlan.from_json(self.kernel_calibration["plan"])
        return self._kernel_plan

    @property
    def plan_exact_width(self) -> int:
        """The widest pass up to which the kernel plan's kernel at every width gave one-token logits bit for bit
        (measure_kernel_plan's check, for this plan: a width where no kernel was exact keeps llama.cpp's own, which
        may not be). The exactness calibrations, measured once whatever the plan, are capped by it."""
        exact = self.kernel_calibration["exact"]
        widest = 1
        for width, kernel in enumerate(self.kernel_plan.kernels[1:], start=2):
            if kernel.describe() not in exact[str(width)]:
                break
            widest = width
        return widest

    @property
    def costs(self) -> PassCosts:
        """Seconds of a pass over each width 1-16 of one sequence after a short context: what the kernel plan's
        calibration timed for the kernel it chose at that width (kernels.measure_kernel_plan: the fastest of up to
        PLAN_REPEATS passes, interleaved with the other candidates', so a busy moment of the machine slows none of
        them in particular). The served passes then correct them (choice.ServedPassCosts)."""
        timed = self.kernel_calibration["pass_s"]
        return PassCosts({width: timed[str(width)][kernel.describe()]
                          for width, kernel in enumerate(self.kernel_plan.kernels, start=1)})

    @property
    def exact_widths(self) -> dict[int, int]:
        """{cached tokens: the widest pass whose logits equal one-token passes bit for bit there}
        (calibration.measure_exact_widths's check, made with the batch calibration on its prompts prefilled alone),
        capped by the kernel plan's own check. Only a target needs it: drafts never have to be exact."""
        # (asked every cycle: kept while the plan and the calibrations it comes from are the same objects)
        sources = self.kernel_plan, self.kernel_calibration, self.batch_calibration
        if self._exact_widths is None or any(a is not b for a, b in zip(self._exact_widths[0], sources)):
            found = sources[2]["exact_width"]
            capped = {int(length): min(width, self.plan_exact_width) for length, width in found.items()}
            self._exact_widths = sources, capped
        return self._exact_widths[1]

    @property
    def prefill_min_tokens(self) -> int | None:
        """The shortest prompt segment that runs in the prefill model (None: there is none): where one pass there
        costs less than passes of up to MAX_WIDTH tokens here, measured (calibration.measure_prefill_split)."""
        if self.prefill_model is None:
            return None
        if self._prefill_min_tokens != "auto":
            return self._prefill_min_tokens
        return self._calibrated("prefill-split", calibration.measure_prefill_split)["min_tokens"]

    @property
    def tiled_whole_columns(self) -> bool:
        """Whether this model's passes of more than MAX_WIDTH tokens keep their tokens in whole column windows of
        ggml's tiled kernels (kernels.apply_tiled_whole_columns: the same results bit for bit, in less time where a
        pass would otherwise unpack its weights more than once): what prepare() measured faster on this machine
        (calibration.measure_tiled_columns); as released (False) until then, so that no request waits for the timing."""
        return bool(self._whole_columns)

    def measure_tiled_columns(self) -> bool:
        """Time this model's prompt blocks with whole column windows and cut as released, once per machine (cached),
        and keep the faster -> tiled_whole_columns."""
        if self._whole_columns is None:
            self._whole_columns = self._calibrated("tiled-columns", calibration.measure_tiled_columns)["whole_columns"]
        return self._whole_columns

    @property
    def merges_passes_from(self) -> int | None:
        """The fewest tokens a prompt segment may have to share a pass with the segments around it (in the model that
        runs a prompt's long segments: the prefill model, or this one where there is none): where passes of that many
        tokens or more were found to give every token the same logits however a prompt is cut into them
        (calibration.measure_pass_merging), else None (one pass per segment)."""
        there = self.prefill_model or self
        return there._calibrated("pass-merging", calibration.measure_pass_merging)["merge_from"]

    @property
    def merges_in_slots(self) -> bool:
        """Whether a sequence alone in a pool of several may merge its prompt's long segments as one in a pool of one
        does: where prepare_as_target found that it reads a prompt so into the logits and cache of a pool of one
        (calibration.measure_slot_merging). False before that, and for a model that is not a target."""
        measured = self._measured.get("slot-merging")
        return bool(measured and measured["exact"]) and not self._self_test_failed

    @property
    def batch_calibration(self) -> dict:
        """What calibration.measure_batch_width found: the exact batch width, whether prompts prefill exactly in
        slots, the contexts checked."""
        return self._calibrated("batch-shapes", calibration.measure_batch_width)

    @property
    def batch_width(self) -> int:
        """The most tokens, over one or several sequences, that a pass may hold while every token still gets the
        logits of a one-token pass of its own sequence."""
        if self._self_test_failed:
            return 1
        return min(self.batch_calibration["batch_width"], min(self.exact_widths.values()))  # (both plan-capped)

    @property
    def alone_in_slot_width(self) -> int:
        """The most tokens a pass of one sequence alone in a slot of a pool of several may hold (a seeded sample's,
        which verifies as it would alone) while every token still gets its one-token logits."""
        if self._self_test_failed:
            return 1
        return min(self.batch_calibration["alone_width"], min(self.exact_widths.values()))

    @property
    def prefills_in_slots_exactly(self) -> bool:
        """Whether a prompt prefilled in a batch slot, beside other sequences, gives the logits and cache of a prompt
        prefilled alone. Where it does not, a batch must serve one request at a time."""
        return self.batch_calibration["prefill_in_slot_exact"]

    def prepare(self) -> None:
        """Calibrate what its passes need (the kernel plan, which times the pass costs, and where prompts run in the
        prefill model) now, not inside the first request (a prompt's prefill would wait for the prefill split's
        timing, and how its prompt blocks cut their work between threads)."""
        self.kernel_plan
        self.prefill_min_tokens
        (self.prefill_model or self).measure_tiled_columns()  # (whichever runs a prompt's blocks)
        self.merges_passes_from

    def prepare_as_target(self) -> None:
        """Calibrate what a target needs (its exact verify and batch widths) now, not inside the first request, and
        check them in this process (self_test, once: a second generator over the loaded model, as `generate --compare`'s
        target-only one, does not run it again)."""
        self.prepare()
        self.exact_widths
        self.batch_width
        if self.merges_passes_from is not None:
            self._calibrated("slot-merging", calibration.measure_slot_merging)
        if not self._self_tested:
            self.self_test()
            self._self_tested = True

    def quick_step_s(self, passes: int = 5) -> float:
        """Seconds of a one-token pass after a short context under the fastest candidate kernel (kernels.candidates,
        llama.cpp's own among them): the fastest of `passes` under each, the kernels interleaved. What a step of this
        model costs before its kernel plan is calibrated, where the plan will give one-token passes the fastest
        kernel whose results are llama.cpp's own (the multi-column kernels' columns are, measure_kernel_plan checks).
        Timed under llama.cpp's own kernel alone, the 0.5B draft's step was 1.17 of the 1.5B target's planned one on
        an Intel Xeon with AMX, where the plan's one-token pass took 47 ms and llama.cpp's own 77. On a thread of its
        own, as the calibrations (calibration.on_a_thread_of_its_own). Measured at every call (a busy moment of the
        machine must not stay in it) and cached per machine and thread count where the weight layout was chosen at
        load, so that a later generator can judge a draft model by it before loading it
        (LlamaCppRuntime.known_step_estimate)."""
        from specdec_exact.runtimes.llamacpp.kernels import candidates

        prefix = calibration.CALIBRATION_CONTEXTS[0]
        tokens = calibration.probe_tokens(self, prefix + 1)

        def measure() -> dict:
            planned = self._kernel_plan
            seconds = {kernel: [] for kernel in candidates()}
            runner = calibration.private_runner(self, tokens.shape[1])
            try:
                self._kernel_plan = KernelPlan.uniform(LLAMA_CPP_KERNELS)
                runner.forward(tokens[:, :prefix], last_only=True)
                for _ in range(passes):
                    calibration.time_one_token_passes(self, runner, tokens, seconds)
            finally:
                runner.close()
                self._kernel_plan = planned
            fastest = min(seconds, key=lambda kernel: min(seconds[kernel]))
            return {"seconds": min(seconds[fastest]), "kernel": fastest.describe()}

        measured = calibration.on_a_thread_of_its_own(measure)
        if self._layout_chosen:
            calibration.store_json(self.path, "step", calibration.step_settings(self.threads, self.kv_cache), measured,
                                   {"threads": self.threads, "passes": passes})
        return measured["seconds"]

    def self_test(self) -> bool:
        """At every load: a pass as wide as the engine will verify, after a short context, against one-token passes
        (under a second: the calibrations read from the cache are keyed by the library build and the CPU, and this
        checks that what they promise holds in this process). Where it does not, the model verifies one token at a
        time from now on, and says so. -> whether the pass was exact."""
        width = self.verify_width(calibration.CALIBRATION_CONTEXTS[0])
        if width > 1:
            prefix = calibration.CALIBRATION_CONTEXTS[0]
            tokens = calibration.probe_tokens(self, prefix + width)
            runner = calibration.private_runner(self, tokens.shape[1])
            try:
                runner.forward(tokens[:, :prefix], last_only=True)
                single = calibration.one_token_logits(runner, tokens[:, prefix:])
                runner.rollback(prefix)
                exact = torch.equal(runner.forward(tokens[:, prefix:])[0], single)
            finally:
                runner.close()
            if not exact:
                log.warning("%s: a pass over %d tokens did not reproduce one-token passes bit for bit, as the "
                            "calibration cached for this library and CPU promised: verifying one token at a time. "
                            "Delete %s to measure again", self.path.name, width,
                            calibration.calibration_folder())
                self._self_test_failed = True
        return not self._self_test_failed

    def verify_width(self, length: int) -> int:
        """The widest pass the engine may verify after `length` cached tokens (>= 1).

        llama.cpp picks kernels by the number of tokens in a pass (and, for some cache types, by the context
        length), and they round differently; a verify pass wider than this could flip a near-tie that plain
        decoding would not. Up to the longest calibrated context it is the narrowest width found exact at any
        calibrated length; beyond that nothing was checked, so passes there verify one token.
        """
        if self._self_test_failed:
            return 1
        widths = self.exact_widths
        return min(widths.values()) if length <= max(widths) else 1

    def fused_pass_cost(self, items) -> float:
        """The cost of one SlotPool.forward_many over these (runner, tokens it feeds) pairs, in one-token passes.

        Over a cache that keeps each sequence apart, llama.cpp evaluates a pass in sub-passes, each over a run of
        sequences with consecutive ids that takes equally many tokens from every one of them
        (llama_batch_allocr::split_equal). So widths [1, 3, 3, 1] over sequences 0-3 run as 4 x 1 tokens, then
        2 x 2; [3, 1, 3, 1] as 4 x 1, then 1 x 2 twice. Each sub-pass streams the weights once and costs what a pass
        over as many tokens of one sequence costs (BENCHMARKS.md, "fused passes")."""
        costs = self.costs
        left = {runner.seq: n for runner, n in items if n > 0}
        cost = 0.0
        while left:
            run = []
            for seq in sorted(left):
                if run and seq != run[-1] + 1:
                    break
                run.append(seq)
            taken = min(left[seq] for seq in run)
            cost += costs.verify_cost(taken * len(run))
            for seq in run:
                left[seq] -= taken
                if not left[seq]:
                    del left[seq]
        return cost

    # ---- sequences

    def pool(self, sequences: int = 1, max_length: int | None = None, prompt_cache: PromptCache | None = None
             ) -> SlotPool:
        """The model's pool for `sequences` sequences of up to max_length tokens (default: the trained context for a
        pool of one, calibration.DEFAULT_SLOT_TOKENS each for several), whose sequences prefill their prompts through
        prompt_cache (None: none) from now on.

        A pool of one (what generate() decodes in) grows with its sequence and hands its slot over when asked while
        held. A pool of several (a batch) is made once and kept while it is in use; an idle one of another shape is
        made again."""
        kind = "solo" if sequences == 1 else "batch"
        # A pool of several allocates every slot up front: by default as long as the calibration checked batches.
        default = self.max_length if sequences == 1 else calibration.DEFAULT_SLOT_TOKENS
        length = min(max_length or default, self.max_length)
        pool = self._pools.get(kind)
        if pool is not None and pool.context.alive and (pool.sequences, pool.max_length) == (sequences, length):
            pool.prompt_cache = prompt_cache
            return pool
        if pool is not None and kind == "batch" and not pool.wait_idle(RELEASE_WAIT_S):
            raise RuntimeError(f"the model's batch of {pool.sequences} sequences is in use: it cannot be made again "
                               f"for {sequences}")
        if pool is not None:
            pool.close()
        self._pools[kind] = SlotPool(self, sequences, length, takeover=sequences == 1)
        self._pools[kind].prompt_cache = prompt_cache
        return self._pools[kind]

    def own_pool(self, max_length: int | None = None, prompt_cache: PromptCache | None = None) -> SlotPool:
        """A pool of one sequence of up to max_length tokens (default: the trained context), as pool(1) makes but
        not kept by the model nor shared with anyone: its context is freed with the pool."""
        pool = SlotPool(self, 1, min(max_length or self.max_length, self.max_length))
        pool.prompt_cache = prompt_cache
        return pool

    def prefill_context(self, n_seq: int, size: int) -> Context:
        """An empty context of n_seq sequences of at least `size` tokens each, for this model's prompt passes (a
        prefill model's: the runner moves a sequence's cache here for its prompt's long segments, and back), kept
        for the next prompt unless it is large (release_prefill_context)."""
        context = self._prefill_context[0]
        if context is None or not context.alive or context.n_seq != n_seq or context.size < size:
            if context is not None:
                context.free()
            size = max(256, 1 << (size - 1).bit_length())  # a power of two: few reallocations
            context = self._prefill_context[0] = Context(self, size, n_seq=n_seq)
        context.clear()
        return context

    def release_prefill_context(self) -> None:
        """Free the prefill context if it is large: a long prompt's cache is not kept around."""
        context = self._prefill_context[0]
        if context is not None and context.size * context.n_seq > 2 * INITIAL_CONTEXT:
            context.free()
            self._prefill_context[0] = None

    @property
    def prefill_tokens_kept(self) -> int:
        """Tokens of the prefill context kept for the next prompt (0: none kept; a long prompt's is freed)."""
        context = self._prefill_context[0]
        return context.size * context.n_seq if context is not None and context.alive else 0

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, threads={self.threads})"


def _free_model(lib, handle, pools: dict, prefill_context: list) -> None:
    for pool in pools.values():
        pool.context.free()
    if prefill_context[0] is not None:
        prefill_context[0].free()
    lib.llama_model_free(handle)
