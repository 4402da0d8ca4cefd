"""The user-facing API: `SpeculativeGenerator(target, draft, k).generate(...)`, `.stream(...)`, `.generate_many(...)`.

Every request takes one path: `request()` builds and checks it (specdec_exact.requests), and a batching.Batch decodes
it, generate() and stream() in a batch of one, generate_many() and the server in a batch of several.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence

import torch

from specdec_exact.adaptive import expected_tokens, make_k_policy
from specdec_exact.adjust import LogitAdjust
from specdec_exact.grammar import Grammar, GrammarTokenizer
from specdec_exact.logprobs import TokenLogprob, check_top, token_logprobs
from specdec_exact.batching import Batch
from specdec_exact.batching import Generation
from specdec_exact.drafters import (CrossVocabDrafter, Drafter, ModelDrafter, SuffixDrafter, TargetInfo, build_drafter,
                                    names_a_model)
from specdec_exact.drafters.choice import ChoosingDrafter, Costs, ServedPassCosts
from specdec_exact.vocabulary import own_vocab_size
from specdec_exact.output import Chunk, GenerationResult
from specdec_exact.prompt_cache import DEFAULT_BUDGET_MB, PromptCache
from specdec_exact.requests import Request
from specdec_exact.runtimes import Runtime, pick_runtime
from specdec_exact.sampling import SamplingConfig

__all__ = ["Chunk", "GenerationResult", "SpeculativeGenerator"]

DEFAULT_MAX_BATCH = 8  # requests generate_many decodes together (on llama.cpp: sequence slots of the target)
# The acceptance per token of the best same-family pairs (Leviathan et al. 2023 measure 0.5-0.9): with k="auto", a
# draft model that would not pay for its steps even then is left out at load (draft_can_pay)
BEST_DRAFT_ACCEPTANCE = 0.9
MOST_DRAFT_TOKENS = 15  # the longest draft the per-cycle choice weighs (a verify pass of 16 tokens)
# A draft model's step time from an earlier load (runtime.known_step_estimate) leaves it out before its load only
# where it could not pay even at this many times its speed: a step timed in a busy moment (the same 0.5B draft timed
# 0.62-0.83 of a target step on one machine) must not keep a draft that pays from ever being loaded again. One that
# is loaded is timed again, and that time is kept for the next load.
KNOWN_STEP_MARGIN = 1.3

log = logging.getLogger("specdec.generator")
PROMPT_PASS_TOKENS = 64  # prompt_logprobs' passes where the runtime says any width is exact


class SpeculativeGenerator:
    """Generates with a target model while a drafter guesses ahead; output is distributed exactly as the target's.

    k: draft tokens per cycle, or "auto" (default) to choose k each cycle from the acceptance and costs observed so
    far; with a draft model on a runtime that calibrates its costs (llama.cpp), "auto" also chooses each cycle between
    suffix lookup, the draft model and plain decoding (drafters.choice), and a draft model that could not pay on this
    machine even with BEST_DRAFT_ACCEPTANCE of its tokens accepted is left out at load: `gen.draft_dropped` says why
    (its steps cost too large a share of the target's, the target's wider passes too much), and lookup drafts alone;
    keep_draft=True keeps it (for a benchmark that measures it: the per-cycle choice then still weighs its costs).
    draft_quantization="int8" runs the draft model with int8 weights: cheaper drafts, exactness untouched (the target
    decides). target_quantization="int8" changes the target itself (a slightly different model, much faster on a CPU);
    output is then exact relative to that int8 target: its passes over several tokens reproduce one-token passes bit
    for bit (models.RowwiseInt8Linear, models.rowwise_attention), and a baseline must use the same int8 target.

    target: a transformers causal LM, a local directory, a .gguf file or a registry name (`specdec-exact models list`).
    draft: None (target-only decoding, the baseline), a drafter name ("ngram", "self:N", ...), a Drafter, or a draft
    model given like the target. Loaded models are shared, never copied: pass `gen.target` to another generator.

    runtime: "torch" (transformers), "llama.cpp" (GGUF files on llama.cpp's kernels; needs llama-cpp-python), or
    "auto": llama.cpp for GGUF models when it is installed, else torch (or a specdec_exact.runtimes.Runtime;
    `gen.runtime` is the one chosen). Target and draft model share the runtime.
    threads: CPU threads (llama.cpp: per model; torch: sets torch's intra-op threads). Default: every core we have.
    prompt_cache: the prompt cache's budget in MB (0: off), or a specdec_exact.prompt_cache.PromptCache to share with
    another generator of the same models. Requests reuse the KV cache of prompt segments that earlier requests
    prefilled, where the runtime does so exactly (llama.cpp): a prompt that starts like an earlier one prefills only
    the rest, and its output is the one it would have without the cache. Target and draft model share its budget;
    `gen.prompt_cache` is it (None where prompts are not cached), with its stats.
    """

    def __init__(self, target, draft=None, k: int | str = "auto", *, tokenizer=None, draft_tokenizer=None,
                 dtype: torch.dtype = torch.float32, target_quantization: str | None = None,
                 draft_quantization: str | None = None, runtime: str | Runtime = "auto",
                 threads: int | None = None, prompt_cache: float | PromptCache = DEFAULT_BUDGET_MB,
                 keep_draft: bool = False):
        make_k_policy(k)  # refuse a bad k now rather than at the first request
        self.k = k
        self.runtime = pick_runtime(runtime, target)  # a specdec_exact.runtimes.Runtime
        self.target_quantization, self.draft_quantization = target_quantization, draft_quantization
        self.target, self.tokenizer = self.runtime.load(target, tokenizer, dtype=dtype,
                                                        quantization=target_quantization, threads=threads)
        self.runtime.check_rollback(self.target)
        self.runtime.prepare_as_target(self.target)
        self.vocab_size = own_vocab_size(self.target, self.tokenizer)
        self._grammar_tokenizer: GrammarTokenizer | None = None
        info = TargetInfo(self.target, self.tokenizer, self.vocab_size, dtype, draft_quantization, self.runtime,
                          threads)
        self.target_costs = self.runtime.costs(self.target)  # PassCosts where the runtime measures them, else None
        # Why the draft model given is not used on this machine (None: it is, or none was given). Where an earlier
        # load timed its step, it is judged before it is loaded, and one that cannot pay is not loaded at all (one to
        # be quantized is loaded: the runtime may refuse that)
        self.draft_dropped = None
        judging = k == "auto" and not keep_draft and self.target_costs
        if judging and draft_tokenizer is None and draft_quantization is None and names_a_model(draft):
            known = self.runtime.known_step_estimate(draft, self.target, threads)
            if known is not None and self._why_the_draft_cannot_pay(known / KNOWN_STEP_MARGIN):
                self.draft_dropped = self._why_the_draft_cannot_pay(known)
        self.drafter, self.draft = (None, None) if self.draft_dropped else build_drafter(draft, info, draft_tokenizer)
        if judging and isinstance(self.drafter, ModelDrafter) and self.draft is not None:
            self.draft_dropped = self._why_the_draft_cannot_pay(self.runtime.step_estimate(self.draft))
        if self.draft_dropped:
            log.warning("the draft model is not used: %s", self.draft_dropped)
            lookup_only = Costs(ServedPassCosts(self.target_costs.verify_cost), draft_step=0.0)
            self.drafter, self.draft = ChoosingDrafter(SuffixDrafter(), None, lookup_only), None
        if self.draft is not None:
            self.runtime.prepare(self.draft)
        # How a draft model with another vocabulary drafts (drafters.cross_vocab), in words; None for the same one.
        self.cross_vocabulary = (self.drafter.vocab.describe() if isinstance(self.drafter, CrossVocabDrafter)
                                 else None)
        self.draft_costs = self.runtime.costs(self.draft) if self.draft is not None else None
        if k == "auto" and isinstance(self.drafter, ModelDrafter) and self.target_costs and self.draft_costs:
            # Where the runtime has calibrated its costs, "auto" also chooses how to draft, each cycle: suffix
            # lookup (free), the draft model, or nothing.
            # A token the draft model takes in while catching up costs what one does in its calibrated 16-token pass.
            c = self.draft_costs.step_s / self.target_costs.step_s
            costs = Costs(ServedPassCosts(self.target_costs.verify_cost), c, c * self.draft_costs.verify_cost(16) / 16)
            self.drafter = ChoosingDrafter(SuffixDrafter(), self.drafter, costs)
        self._tenants_drafters: dict[str, Drafter] = {}  # tenant -> the drafter whose history its requests share
        # The prompt cache its requests prefill through, where the runtime caches prompts (None: every prompt is
        # prefilled whole)
        self.prompt_cache = prompt_cache if isinstance(prompt_cache, PromptCache) else PromptCache.of_megabytes(
            prompt_cache)
        if not (self.runtime.caches_prompts and self.prompt_cache.enabled):
            self.prompt_cache = None
        self.eos_ids = self.runtime.eos_ids(self.target) | (
            {self.tokenizer.eos_token_id} if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else set())
        if hasattr(self.target, "answer_start"):
            # The runtime prefills a chat's answers as decoding computed them, and caches an answer for the
            # conversation's next turn: it must know where answers are (with or without a cache: the same passes)
            self.target.answer_start, self.target.answer_end = answer_marks(self.tokenizer)

    def _why_the_draft_cannot_pay(self, step: float | None) -> str | None:
        """Given the seconds of a draft model's step (runtime.step_estimate, before it is calibrated; None where the
        runtime does not time it): why it cannot pay on this machine (draft_can_pay), in words; None where it may."""
        if step is None:
            return None
        c, verify = step / self.target_costs.step_s, self.target_costs.verify_cost
        if draft_can_pay(c, verify, MOST_DRAFT_TOKENS):
            return None
        return (f"on this machine a step of it costs {c:.2f} of a target step and a target pass over 2 tokens "
                f"{verify(2):.2f} of one over 1 token, so even with {BEST_DRAFT_ACCEPTANCE:.0%} of its tokens accepted "
                f"no draft of 1-{MOST_DRAFT_TOKENS} tokens would beat plain decoding; drafting by suffix lookup alone")

    def drafter_for(self, tenant: str | None) -> Drafter:
        """The drafter whose forks a tenant's requests draft with: its lookup history is that tenant's earlier
        requests alone (None: the generator's own drafter, shared by every request without a tenant)."""
        if tenant is None:
            return self.drafter
        if tenant not in self._tenants_drafters:
            self._tenants_drafters[tenant] = self.drafter.fork(shared_history=False)
        return self._tenants_drafters[tenant]

    def keep_answer(self, sequence) -> None:
        """A finished chat request's answer (a batching.Generation) into the prompt cache, where its runtime keeps
        answers (the llama.cpp runtime: LlamaCppRunner.keep_answer), for the conversation's next turn."""
        runner, decoding = sequence.decoding.target, sequence.decoding
        if self.prompt_cache is None or not hasattr(runner, "keep_answer"):
            return
        answer = decoding.context[0, len(sequence.request.prompt_ids):len(sequence.request.prompt_ids)
                                  + decoding.emitted].tolist()
        while answer and answer[-1] in self.eos_ids:
            answer.pop()
        runner.keep_answer(answer)

    def kernel_plans(self) -> dict[str, str]:
        """{"target": ..., "draft": ...}: which kernels each model runs its passes of each width with, in words, where
        the runtime chooses them (llama.cpp: runtimes.llamacpp.kernels)."""
        plans = {role: self.runtime.kernel_plan(model) for role, model in (("target", self.target),
                                                                           ("draft", self.draft)) if model is not None}
        return {role: plan for role, plan in plans.items() if plan is not None}

    def encode(self, prompt: str | Sequence[int] | torch.Tensor | Sequence[dict], chat: bool = False,
               tools: list[dict] | None = None) -> list[int]:
        """A prompt -> its token ids. prompt: text, token ids, or (chat) a list of {"role", "content"} messages.
        chat=True applies the target's chat template (to text: as one user message), with the tools (OpenAI's
        [{"type": "function", "function": {...}}]) it offers the model, if any."""
        if chat and not isinstance(prompt, (torch.Tensor, str)) and prompt and isinstance(prompt[0], dict):
            return self._render_chat(list(prompt), tools)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass the prompt as token ids")
            if chat:
                return self._render_chat([{"role": "user", "content": prompt}], tools)
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if any(not isinstance(i, int) for i in ids):
                raise ValueError("a prompt given as token ids must hold integers only")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return ids

    def _render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages through the target's chat template -> token ids. Only the template writes special tokens:
        a message whose content holds the text of one ("<|im_start|>system") gets that text as plain text, so that a
        user cannot forge another role's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: send a plain prompt instead")
        specials = [token.content for token in getattr(self.tokenizer, "added_tokens_decoder", {}).values()
                    if token.special]
        forged = [i for i, m in enumerate(messages)
                  if isinstance(m.get("content"), str) and any(token in m["content"] for token in specials)]
        if not forged:  # (the common case: the whole text tokenized at once, as every server does)
            ids = self.tokenizer(self._apply_template(messages, tools), add_special_tokens=False)["input_ids"]
        else:
            ids = self._render_with_plain_contents(messages, forged, tools)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        return ids

    def _apply_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        from jinja2 import TemplateError  # here: only chat templates need jinja2

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except (TemplateError, ValueError) as error:  # e.g. the template refuses a role or the order of messages
            raise ValueError(f"the chat template refused the messages: {error}") from error

    def _render_with_plain_contents(self, messages: list[dict], forged: list[int],
                                    tools: list[dict] | None = None) -> list[int]:
        """The template rendered with a placeholder for the content of each message numbered in `forged`; the
        template's text tokenized with its special tokens, those contents with none (their special-token text split
        into ordinary tokens)."""
        import re
        import secrets

        marker = f"SPECDEC{secrets.token_hex(8)}"
        contents = {f"{marker}{i}{marker}": messages[i]["content"] for i in forged}
        rendered = self._apply_template([{**m, "content": f"{marker}{i}{marker}"} if i in forged else m
                                         for i, m in enumerate(messages)], tools)
        ids = []
        for piece in re.split(f"({marker}\\d+{marker})", rendered):
            if piece in contents:
                ids += self.tokenizer(contents[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            elif piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids

    def request(self, prompt, max_new_tokens: int | None = 128, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (), chat: bool = False,
                k: int | str | None = None, max_length: int | None = None, tenant: str | None = None,
                logprobs: int | None = None, adjust: LogitAdjust | None = None,
                grammar: Grammar | None = None, tools: list[dict] | None = None) -> Request:
        """One request, built and checked: the prompt encoded (see encode), the settings validated, and prompt plus
        max_new_tokens checked against max_length (default: the target's context), the tokens one sequence holds.
        max_new_tokens None: as many as the context has room for. Raises ValueError (ContextLengthExceeded when it
        does not fit). tenant: whose earlier requests it may draw on (Request.tenant). logprobs: each new token's
        log-probability and this many most likely alternatives (specdec_exact.logprobs; None: none). adjust: a logit
        bias and presence and frequency penalties (specdec_exact.adjust.LogitAdjust), applied to the target's logits at
        every position, draft positions included, before sampling. grammar: what the output must follow
        (specdec_exact.grammar: Grammar.json_schema(...), .json_object(), .regex(...), .lark(...)), every row masked by
        it. tools: the tools the chat template offers the model (encode; specdec_exact.tools reads the calls it
        writes)."""
        limit = self.context_length if max_length is None else max_length
        ids = self.encode(prompt, chat, tools)
        if max_new_tokens is None:
            max_new_tokens = max(limit - len(ids), 0)
        request = Request(tuple(ids), max_new_tokens, SamplingConfig(temperature, top_k, top_p), seed,
                          tuple(s for s in stop if s), self.k if k is None else k, tenant, logprobs, adjust,
                          grammar)
        if adjust is not None:
            adjust.check_vocab(self.vocab_size)
        if grammar is not None:
            self.grammar_tokenizer()  # (built now, off the decoding thread; a tokenizer it cannot read is refused)
        make_k_policy(request.k)  # a bad k is refused here, not at the first cycle
        request.check_fits(limit)
        return request

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
               chat: bool = False, k: int | str | None = None, tenant: str | None = None,
               logprobs: int | None = None, adjust: LogitAdjust | None = None,
               grammar: Grammar | None = None) -> Iterator[Chunk]:
        """Yield chunks of new text as soon as each cycle commits them; the last chunk carries the stats. tenant:
        whose earlier requests it may draw on (Request.tenant); logprobs: as generate's, on each chunk; adjust,
        grammar: as generate's."""
        yield from self.decode(self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, k,
                                            tenant=tenant, logprobs=logprobs, adjust=adjust, grammar=grammar))

    def decode(self, request: Request) -> Iterator[Chunk]:
        """One request's chunks as each cycle commits them, decoded in a batch of one."""
        for _, chunk in self._decode_alone(request):
            yield chunk

    def _decode_alone(self, request: Request) -> Iterator[tuple[Generation, Chunk]]:
        batch = Batch(self, max_batch=1)
        try:  # however it ends (finished, failed, or the caller stopped reading), its sequences go back
            sequence = batch.add(request)
            if sequence.last is not None:
                yield sequence, sequence.last
                return
            while True:
                for _, chunk in batch.step():  # (nothing while the prompt is read, a pass a step)
                    if isinstance(chunk, Exception):
                        raise chunk
                    yield sequence, chunk
                    if chunk.finish_reason:
                        return
        finally:
            batch.close()

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 chat: bool = False, k: int | str | None = None, tenant: str | None = None,
                 logprobs: int | None = None, adjust: LogitAdjust | None = None,
                 grammar: Grammar | None = None) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt (text or token ids). temperature 0 is greedy. tenant: whose
        earlier requests it may draw on, its cached prompts and the suffix lookup's history (Request.tenant; None:
        those of every other request without a tenant). logprobs: the result carries each new token's
        log-probability under the target and this many most likely alternatives at its position (0-20; None: none),
        bit for bit those of target-only decoding. adjust: a logit bias and penalties; grammar: what the output must
        follow (both: see request)."""
        request = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, k, tenant=tenant,
                               logprobs=logprobs, adjust=adjust, grammar=grammar)
        for sequence, _ in self._decode_alone(request):
            pass
        return sequence.output.result()

    def generate_many(self, prompts: Sequence, max_new_tokens: int = 128, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                      stop: Sequence[str] = (), chat: bool = False, max_batch: int = DEFAULT_MAX_BATCH,
                      logprobs: int | None = None, adjust: LogitAdjust | None = None,
                      grammar: Grammar | None = None) -> list[GenerationResult]:
        """Generate for several prompts at once: each cycle, every unfinished prompt drafts on its own and one target
        pass verifies all of their drafts (batched speculative decoding: fused on llama.cpp; other runtimes take
        turns within the cycle).

        Each prompt has its own drafter state, k, stats and random stream (seeded with seed + its index), and what it
        produces does not depend on the other prompts: greedy output is the target's own, as generate()'s is, and a
        seeded sample is the one generate(prompt, seed=seed + index) gives. A pass holds at most the target's
        calibrated batch width of tokens, within which every token's logits are those of a one-token pass of its own
        sequence; prompts draft within their share of it (a seeded sample drafts as it would alone), and what does
        not fit takes further passes. Results come in the order of the prompts. logprobs, adjust, grammar: as
        generate's.
        """
        requests = [self.request(prompt, max_new_tokens, temperature, top_k, top_p,
                                 None if seed is None else seed + i, stop, chat, logprobs=logprobs, adjust=adjust,
                                 grammar=grammar)
                    for i, prompt in enumerate(prompts)]
        batch = Batch(self, max_batch=max(1, min(max_batch, len(requests))))
        sequences, pending = [], list(requests)
        try:
            while pending or batch.active:
                while pending and batch.has_room():  # continuous batching: join as soon as a slot is free
                    sequences.append(batch.add(pending.pop(0)))
                for _, outcome in batch.step():
                    if isinstance(outcome, Exception):
                        raise outcome
                batch.keep_answers()  # (frees the finished requests' slots for the pending ones)
        finally:
            batch.close()
        return [sequence.output.result() for sequence in sequences]

    def prompt_logprobs(self, prompt_ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
        """Each prompt token's log-probability after the tokens before it (the first's is None: nothing comes before
        it), with the `top` most likely tokens at its position: what an evaluation harness reads (the
        server's echo). The prompt runs in a sequence of its own, in passes no wider than the exact verify width,
        so every row is bit for bit that of a one-token pass, as the logprobs of generated tokens are."""
        check_top(top)
        ids = list(prompt_ids)
        runner = self.runtime.own_pool(self.target, len(ids) + 1).take(self.vocab_size)
        rows: list[torch.Tensor] = []  # row i: after ids[:i + 1], the distribution of ids[i + 1]
        try:
            while len(rows) < len(ids) - 1:
                width = runner.verify_width(len(rows)) or PROMPT_PASS_TOKENS  # (None: any width is exact)
                rows.extend(runner.forward(torch.tensor([ids[len(rows):min(len(rows) + width, len(ids) - 1)]]))[0])
        finally:
            runner.close()
        first = TokenLogprob(ids[0], None)
        return [first, *token_logprobs(torch.stack(rows), ids[1:], top)] if rows else [first]

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The target's tokenizer as the grammars read it (built at the first constrained request, then kept)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammar_tokenizer

    @property
    def context_length(self) -> int:
        """Tokens the target's context holds (prompt and generated tokens together)."""
        return self.runtime.context_length(self.target)

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token of one request takes: the target's and the draft model's together."""
        models = [model for model in (self.target, self.draft) if model is not None]
        return sum(self.runtime.kv_bytes_per_token(model) for model in models)

    def k_priors(self) -> dict:
        """Costs that a runtime measured when it loaded the models: a better start for k="auto" than the defaults,
        which assume a verify pass that barely grows with its width."""
        priors = {}
        if self.target_costs is not None:
            priors["prior_verify_slope"] = self.target_costs.verify_slope
            if self.draft_costs is not None:
                priors["prior_draft_cost"] = self.draft_costs.step_s / self.target_costs.step_s
        return priors


def draft_can_pay(draft_step: float, verify_cost: Callable[[int], float], most_tokens: int,
                  acceptance: float = BEST_DRAFT_ACCEPTANCE) -> bool:
    """Whether some draft of k <= most_tokens tokens, each accepted with probability `acceptance`, yields more tokens
    per unit of target time than plain decoding: expected_tokens(acceptance, k) > k * draft_step + verify_cost(k + 1),
    costs in one-token target passes (a draft model's step; a target pass over w tokens)."""
    return any(expected_tokens(acceptance, k) > k * draft_step + verify_cost(k + 1)
               for k in range(1, most_tokens + 1))


def answer_marks(tokenizer) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(the tokens a tokenizer's chat template writes before an assistant's reply, those it writes after it), from
    the template itself: the prompt it renders for a question with and without the generation prompt, and with a
    reply. (None, None) where it has no template or they cannot be told apart."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None, None
    question, reply = [{"role": "user", "content": "Q"}], "SPECDEC-REPLY"
    try:
        asked = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        bare = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=False)
        answered = tokenizer.apply_chat_template([*question, {"role": "assistant", "content": reply}],
                                                 tokenize=False, add_generation_prompt=False)
    except Exception:  # a template that refuses these messages (jinja2 errors and others): no answers
        return None, None
    if not (asked.startswith(bare) and answered.startswith(asked) and reply in answered[len(asked):]):
        return None, None
    before, after = asked[len(bare):], answered[len(asked):].split(reply, 1)
    if after[0] or not before:
        return None, None
    start = tuple(tokenizer(before, add_special_tokens=False)["input_ids"])
    end = tuple(tokenizer(after[1], add_special_tokens=False)["input_ids"])
    return (start, end) if start else (None, None)
