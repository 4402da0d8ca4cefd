"""The user-facing API: `SpeculativeGenerator(target, draft, k).generate(...)` and `.stream(...)`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from specdec.adaptive import K_MAX, make_k_policy
from specdec.drafters import CrossVocabDrafter, ModelDrafter, SuffixDrafter, TargetInfo, build_drafter
from specdec.drafters.choice import ChoosingDrafter, Costs
from specdec.engine import Decoding, batch_cycle, speculative_decode
from specdec.metrics import SpecStats
from specdec.models import own_vocab_size
from specdec.runners import new_runner
from specdec.runtimes import Runtime, pick_runtime
from specdec.sampling import SamplingConfig, make_generator


DEFAULT_MAX_BATCH = 8  # requests generate_many decodes together (on llama.cpp: sequence slots of the target)


@dataclass
class Chunk:
    """What one cycle adds to the output, as soon as it is committed."""
    text: str  # new text since the previous chunk (held back while it may be the start of a stop string)
    token_ids: list[int]  # tokens committed by this cycle
    n_from_draft: int  # the first n_from_draft token_ids were authored by the drafter and accepted by the target
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    stats: SpecStats | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (no prompt, no end-of-sequence token)
    text: str  # decoded new tokens, cut before any stop string ("" without a tokenizer)
    stats: SpecStats
    finish_reason: str
    from_draft: list[bool] = field(default_factory=list)  # per token: authored by the drafter


class SpeculativeGenerator:
    """Generates with a target model while a drafter guesses ahead; output is distributed exactly as the target's.

    k: draft tokens per cycle, or "auto" (default) to choose k each cycle from the acceptance and costs observed so
    far; with a draft model on a runtime that calibrates its costs (llama.cpp), "auto" also chooses each cycle between
    suffix lookup, the draft model and plain decoding (drafters.choice).
    draft_quantization="int8" runs the draft model with int8 weights: cheaper drafts, exactness untouched (the target
    decides). target_quantization="int8" changes the target itself (a slightly different model, much faster on a CPU);
    output is then exact relative to that int8 target: its passes over several tokens reproduce one-token passes bit
    for bit (models.RowwiseInt8Linear, models.rowwise_attention), and a baseline must use the same int8 target.

    target: a transformers causal LM, a local directory, a .gguf file or a registry name (`specdec models list`).
    draft: None (target-only decoding, the baseline), a drafter name ("ngram", "self:N", ...), a Drafter, or a draft
    model given like the target. Loaded models are shared, never copied: pass `gen.target` to another generator.

    runtime: "torch" (transformers), "llama.cpp" (GGUF files on llama.cpp's kernels; needs llama-cpp-python), or
    "auto": llama.cpp for GGUF models when it is installed, else torch (or a specdec.runtimes.Runtime; `gen.runtime`
    is the one chosen). Target and draft model share the runtime.
    threads: CPU threads (llama.cpp: per model; torch: sets torch's intra-op threads). Default: every core we have.
    """

    def __init__(self, target, draft=None, k: int | str = "auto", *, tokenizer=None, draft_tokenizer=None,
                 dtype: torch.dtype = torch.float32, target_quantization: str | None = None,
                 draft_quantization: str | None = None, runtime: str | Runtime = "auto",
                 threads: int | None = None):
        make_k_policy(k)  # refuse a bad k now rather than at the first request
        self.k = k
        self.runtime = pick_runtime(runtime, target)  # a specdec.runtimes.Runtime
        self.target_quantization, self.draft_quantization = target_quantization, draft_quantization
        self.target, self.tokenizer = self.runtime.load(target, tokenizer, dtype=dtype,
                                                        quantization=target_quantization, threads=threads)
        self.runtime.check_rollback(self.target)
        prepare = getattr(self.target, "prepare_as_target", None)  # a runtime's one-off calibration, if it has one
        if prepare is not None:
            prepare()
        self.vocab_size = own_vocab_size(self.target, self.tokenizer)
        info = TargetInfo(self.target, self.tokenizer, self.vocab_size, dtype, draft_quantization, self.runtime,
                          threads)
        self.drafter, self.draft = build_drafter(draft, info, draft_tokenizer)
        # How a draft model with another vocabulary drafts (drafters.cross_vocab), in words; None for the same one.
        self.cross_vocabulary = (self.drafter.vocab.describe() if isinstance(self.drafter, CrossVocabDrafter)
                                 else None)
        if (k == "auto" and isinstance(self.drafter, ModelDrafter) and hasattr(self.target, "verify_cost")
                and hasattr(self.draft, "step_s")):
            # Where the runtime has calibrated its costs, "auto" also chooses how to draft, each cycle: suffix
            # lookup (free), the draft model, or nothing.
            # A token the draft model takes in while catching up costs what one does in its calibrated 16-token pass.
            c = self.draft.step_s / self.target.step_s
            costs = Costs(self.target.verify_cost, c, c * self.draft.verify_cost(16) / 16)
            self.drafter = ChoosingDrafter(SuffixDrafter(), self.drafter, costs)
        self.eos_ids = _eos_ids(self.target, self.tokenizer)

    def kernel_plans(self) -> dict[str, str]:
        """{"target": ..., "draft": ...}: which kernels each llama.cpp model runs its passes of each width with (see
        specdec.kernels), in words; models of other runtimes have none."""
        models = {"target": self.target, "draft": self.draft}
        return {role: model.kernel_plan.describe() for role, model in models.items()
                if getattr(model, "kernel_plan", None) is not None}

    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = False) -> torch.Tensor:
        """A prompt (text, or token ids) -> ids [1, n]. chat=True applies the target's chat template to text."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass the prompt as token ids")
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                          add_generation_prompt=True)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return torch.tensor([ids], dtype=torch.long)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
               chat: bool = False, k: int | str | None = None) -> Iterator[Chunk]:
        """Yield chunks of new text as soon as each cycle commits them; the last chunk carries the stats."""
        yield from self._stream(self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, k))

    def _stream(self, request: Request) -> Iterator[Chunk]:
        runner = new_runner(self.target, self.vocab_size)
        request.check_length(runner)
        # A seeded sample depends on how much is drafted each cycle, so it must not depend on what this generator
        # served before (suffix lookup's history of earlier requests): it drafts with a drafter of its own, as a
        # request in a batch does.
        drafter = self.drafter.fork() if request.seeded_sample else self.drafter
        try:
            steps = speculative_decode(runner, drafter, request.prompt_ids, k=request.k_policy(drafter),
                                       max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                                       generator=request.generator, eos_ids=self.eos_ids, stats=request.stats)
            for step in steps:
                chunk = request.output.chunk(step)
                yield chunk
                if chunk.finish_reason:
                    return
            yield request.output.end()
        finally:
            if drafter is not self.drafter:
                drafter.close()

    def generate_many(self, prompts: Sequence, max_new_tokens: int = 128, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                      stop: Sequence[str] = (), chat: bool = False) -> list[GenerationResult]:
        """Generate for several prompts at once: each cycle, every unfinished prompt drafts on its own and one target
        pass verifies all of their drafts (batched speculative decoding; llama.cpp only, other runtimes take turns).

        Each prompt has its own drafter state, k, stats and random stream (seeded with seed + its index), and what it
        produces does not depend on the other prompts: greedy output is the target's own, as generate()'s is, and a
        seeded sample is the one generate(prompt, seed=seed + index) gives. Each prompt drafts with a copy of the
        generator's drafter (Drafter.fork: a draft model gets a sequence slot per prompt; its steps are not fused).
        A pass holds at most the target's calibrated batch width of tokens (on llama.cpp with specdec's kernels, 16),
        within which every token's logits are those of a one-token pass of its own sequence; prompts draft within
        their share of it (a seeded sample drafts as it would alone), and what does not fit takes further passes.
        Results come in the order of the prompts.
        """
        requests = [self.request(prompt, max_new_tokens, temperature, top_k, top_p,
                                 None if seed is None else seed + i, stop, chat)
                    for i, prompt in enumerate(prompts)]
        batch, pending = Batch(self), list(requests)
        try:
            while pending or batch.active:
                while pending and batch.has_room():  # continuous batching: join as soon as a slot is free
                    batch.add(pending.pop(0))
                batch.step()
        finally:
            batch.close()
        return [request.output.result() for request in requests]

    def request(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (), chat: bool = False,
                k: int | str | None = None) -> Request:
        """One request's settings, checked, and its output under construction (for a Batch)."""
        sampling = SamplingConfig(temperature, top_k, top_p)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        stats = SpecStats()
        return Request(self.encode(prompt, chat), sampling, make_generator(seed), self.k if k is None else k,
                       self._k_priors(), stats, _Output(self.tokenizer, stop, stats), seed, max_new_tokens)

    @property
    def context_length(self) -> int:
        """Tokens the target's context holds (prompt and generated tokens together)."""
        return self.runtime.context_length(self.target)

    def _k_priors(self) -> dict:
        """Costs that a runtime measured when it loaded the models: a better start for k="auto" than the defaults,
        which assume a verify pass that barely grows with its width."""
        priors = {}
        if hasattr(self.target, "verify_slope"):
            priors["prior_verify_slope"] = self.target.verify_slope
            if hasattr(self.draft, "step_s"):
                priors["prior_draft_cost"] = self.draft.step_s / self.target.step_s
        return priors

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 chat: bool = False, k: int | str | None = None) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt (text or token ids). temperature 0 is greedy."""
        request = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, k)
        for chunk in self._stream(request):
            request.output.collect(chunk)
        return request.output.result()


@dataclass(eq=False)
class Request:
    """One generation request: its prompt, sampling settings, random stream, stats and output so far."""
    prompt_ids: torch.Tensor  # [1, n]
    sampling: SamplingConfig
    generator: torch.Generator
    k: int | str
    k_priors: dict
    stats: SpecStats
    output: _Output
    seed: int | None
    max_new_tokens: int

    @property
    def seeded_sample(self) -> bool:
        """A sample that must repeat for its seed: what it drafts decides how its random stream is used."""
        return self.seed is not None and not self.sampling.greedy

    def k_policy(self, drafter):
        if getattr(drafter, "chooses_k", False):  # the drafter decides; k only caps it
            return make_k_policy(K_MAX if self.k == "auto" else self.k)
        # A seeded sample must not depend on the clock: k decides how the random stream is consumed.
        timed = not self.seeded_sample
        return make_k_policy(self.k, timed=timed, **self.k_priors)

    def check_length(self, runner) -> None:
        if self.prompt_ids.shape[1] >= runner.max_length:
            raise ValueError(f"the prompt has {self.prompt_ids.shape[1]} tokens; the target's context holds "
                             f"{runner.max_length}: shorten the prompt")


class Batch:
    """Requests decoded together: each step is one cycle of every unfinished request, their target passes fused
    (engine.batch_cycle). Requests join with add() between steps while has_room(), and leave when they finish or
    are dropped. What SpeculativeGenerator.generate_many and the server's scheduler run."""

    def __init__(self, generator: SpeculativeGenerator, max_batch: int | None = None):
        self.generator = generator
        self.fused = hasattr(generator.target, "new_batch_runner")
        self.max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        if self.fused and not generator.target.prefills_in_slots_exactly:
            # The calibration found that a prompt prefilled in a batch slot is not the prompt prefilled alone: one
            # request at a time then, in the model's own context, exactly as generate() runs it.
            warnings.warn("on this CPU a prompt prefilled in a batch slot differs from one prefilled alone "
                          "(measure_batch_width): requests are served one at a time", RuntimeWarning, stacklevel=2)
            self.fused, self.max_batch = False, 1
        self.active: list[tuple[Request, Decoding]] = []
        # The batch contexts now, with a slot per request for the target and for each request's draft-model drafter
        # (whose forks would otherwise take the runtime's default number of slots).
        for model in (generator.target, generator.draft) if self.fused else ():
            reserve = getattr(model, "reserve_batch", None)
            if reserve is not None:
                reserve(self.max_batch)

    def has_room(self) -> bool:
        return self.room() > 0

    def room(self) -> int:
        """Requests that add() can start now."""
        room = self.max_batch - len(self.active)
        return min(room, self.generator.target.free_batch_slots(self.max_batch)) if self.fused else room

    def add(self, request: Request) -> Chunk | None:
        """Start a request: a sequence slot, a drafter of its own, the prefill. -> its last chunk if that already ends
        it (nothing to generate), else None. A request the model refuses (too long) raises ValueError."""
        gen = self.generator
        runner = (gen.target.new_batch_runner(gen.vocab_size, slots=self.max_batch) if self.fused
                  else new_runner(gen.target, gen.vocab_size))
        drafter = gen.drafter.fork()
        try:
            request.check_length(runner)
            # Greedy output is the same whatever is drafted, so a batch may cap its drafts; a seeded sample is not.
            decoding = Decoding(runner, drafter, request.prompt_ids, k=request.k_policy(drafter),
                                max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                                generator=request.generator, eos_ids=gen.eos_ids, stats=request.stats,
                                pinned_k=request.seeded_sample)
        except BaseException:
            _close(runner)
            drafter.close()
            raise
        if decoding.done:
            _end(decoding)
            return request.output.collect(request.output.end())
        self.active.append((request, decoding))
        return None

    def step(self) -> list[tuple[Request, Chunk]]:
        """One cycle of every active request -> each one's chunk (finished requests leave the batch)."""
        if not self.active:
            return []
        target = self.generator.target
        fused_width = target.batch_width if self.fused else (K_MAX + 1) * len(self.active)
        pass_cost = getattr(target, "fused_pass_cost", None) if self.fused else None
        steps = batch_cycle([decoding for _, decoding in self.active], fused_width, pass_cost)
        chunks, still = [], []
        for (request, decoding), step in zip(self.active, steps):
            chunk = request.output.collect(request.output.chunk(step))
            chunks.append((request, chunk))
            if chunk.finish_reason:  # a stop string may end it before the engine would
                _end(decoding)
            else:
                still.append((request, decoding))
        self.active = still
        return chunks

    def drop(self, request: Request) -> None:
        """End a request early (its client left): its slot is free for the next."""
        for entry in self.active:
            if entry[0] is request:
                self.active.remove(entry)
                _end(entry[1])
                return

    def close(self) -> None:
        for _, decoding in self.active:
            _end(decoding)
        self.active = []


class _Output:
    """A request's steps turned into chunks (text detokenized, cut at stop strings) and gathered into a result."""

    def __init__(self, tokenizer, stop: Sequence[str], stats: SpecStats):
        self.text = _Detokenizer(tokenizer, stop)
        self.stats = stats
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        self.texts: list[str] = []
        self.finish_reason: str | None = None

    def chunk(self, step) -> Chunk:
        delta, kept, stopped = self.text.add(step.tokens)
        tokens, n_from_draft = step.tokens[:kept], min(step.n_from_draft, kept)
        if stopped:
            self.stats.new_tokens -= len(step.tokens) - kept
            return Chunk(delta, tokens, n_from_draft, "stop", self.stats)
        if step.finish_reason:
            return Chunk(delta + self.text.flush(), tokens, n_from_draft, step.finish_reason, self.stats)
        return Chunk(delta, tokens, n_from_draft)

    def end(self) -> Chunk:
        """The last chunk when generation ended without a finish reason (no tokens asked for)."""
        return Chunk(self.text.flush(), [], 0, "length", self.stats)

    def collect(self, chunk: Chunk) -> Chunk:
        self.token_ids += chunk.token_ids
        self.from_draft += [i < chunk.n_from_draft for i in range(len(chunk.token_ids))]
        self.texts.append(chunk.text)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        return chunk

    def result(self) -> GenerationResult:
        return GenerationResult(self.token_ids, "".join(self.texts), self.stats, self.finish_reason,
                                self.from_draft)


class _Detokenizer:
    """Incremental decoding that never emits half a character or a prefix of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted

    def add(self, tokens: list[int]) -> tuple[str, int, bool]:
        """-> (text safe to emit now, how many of tokens to keep, whether a stop string was reached: then generation
        ends here, after the fewest tokens that complete it, and nothing from the stop string on is emitted)."""
        if self.tokenizer is None:
            return "", len(tokens), False
        text = self._decode(tokens)
        if self._stop_in(text) is not None:
            kept = next(n for n in range(1, len(tokens) + 1) if self._stop_in(self._decode(tokens[:n])) is not None)
            text = self._decode(tokens[:kept])
            self.ids += tokens[:kept]
            delta, self.sent = text[self.sent:self._stop_in(text)], len(text)
            return delta, kept, True
        self.ids += tokens
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character waits for its remaining tokens
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if text[safe - n:safe] == s[:n]:
                    safe -= n
                    break
        delta, self.sent = text[self.sent:safe], max(self.sent, safe)
        return delta, len(tokens), False

    def _decode(self, extra: list[int] = ()) -> str:
        return self.tokenizer.decode(self.ids + list(extra), skip_special_tokens=True)

    def _stop_in(self, text: str) -> int | None:
        """Where the first stop string starts in text (searching only what was not sent yet), or None."""
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def flush(self) -> str:
        """The text held back so far (at the end of generation)."""
        if self.tokenizer is None:
            return ""
        text = self._decode()
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta


def _close(runner) -> None:
    close = getattr(runner, "close", None)  # a batch slot's runner gives its slot back
    if close is not None:
        close()


def _end(decoding: Decoding) -> None:
    """A batched request is over: its sequence slots (target, draft model) are free for the next."""
    _close(decoding.target)
    decoding.drafter.close()


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: the generation config's (often several for chat models) and the tokenizer's."""
    ids = set(getattr(model, "eos_ids", ()))  # a GGUF model's end-of-generation tokens, read by its runtime
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
