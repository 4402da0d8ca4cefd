"""The default pair on the llama.cpp runtime (its own Q4_K_M GGUF files) on real HumanEval prompts.

Greedy output of every drafter must equal target-only greedy on the same runtime, token for token.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec_exact import SpeculativeGenerator, registry
from specdec_exact.runtimes import LLAMA_CPP, llamacpp, runtime_of
from conftest import (chat, conversation_prompts, conversation_requests, human_eval_prompts,
                      prefill_through, prefills_in_passes_of, serve)

pytestmark = pytest.mark.real_model

NEW_TOKENS = 48
CROSS_DRAFT = "smollm2-135m-instruct"  # a draft with a tokenizer of its own


@pytest.fixture(scope="module")
def pair():
    from specdec_exact.runtimes import llamacpp

    problems = [] if llamacpp.installed() else [f"llama-cpp-python is not installed: run `make setup`"]
    problems += [f"{name} is not installed: run `specdec-exact models pull {name} --runtime llama.cpp`"
                 for name in (registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT) if not registry.gguf_ready(name)]
    if problems:
        if os.environ.get("SPECDEC_REQUIRE_REAL_MODELS"):
            pytest.fail("; ".join(problems))
        pytest.skip("; ".join(problems))
    speculative = SpeculativeGenerator(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, k=2, runtime="llama.cpp")
    baseline = SpeculativeGenerator(speculative.target, None, tokenizer=speculative.tokenizer)
    return speculative, baseline


@pytest.fixture(scope="module")
def references(pair):
    _, baseline = pair
    return {prompt: baseline.generate(prompt, max_new_tokens=NEW_TOKENS) for prompt in human_eval_prompts(2)}


@pytest.mark.parametrize("drafter", ["draft", "ngram", "hybrid", "auto"])
def test_every_drafter_keeps_greedy_output_identical(pair, references, drafter):
    speculative, _ = pair
    if drafter == "draft":
        gen = speculative
    elif drafter == "auto":
        gen = SpeculativeGenerator(speculative.target, speculative.drafter, k="auto", tokenizer=speculative.tokenizer)
    elif drafter == "hybrid":
        from specdec_exact.drafters import HybridDrafter, NgramDrafter

        gen = SpeculativeGenerator(speculative.target, HybridDrafter(NgramDrafter(), speculative.drafter), k=2,
                                   tokenizer=speculative.tokenizer)
    else:
        gen = SpeculativeGenerator(speculative.target, drafter, k=2, tokenizer=speculative.tokenizer)
    for prompt, ref in references.items():
        out = gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == ref.token_ids, drafter
        print(f"{drafter}: {out.stats.tokens_per_s:.2f} tok/s vs target-only {ref.stats.tokens_per_s:.2f}, "
              f"acceptance {out.stats.acceptance_rate:.0%}, mean accepted length {out.stats.mean_accepted_length:.2f}")
    if drafter == "draft":
        assert out.stats.acceptance_rate > 0.5  # the same-family draft on code


@pytest.mark.parametrize("k", [3, "auto"])
def test_a_draft_with_another_tokenizer_keeps_greedy_output_identical(pair, references, k):
    """SmolLM2-135M (its own 49,152-token vocabulary) drafting for the Qwen target, across vocabularies."""
    speculative, _ = pair
    if not registry.gguf_ready(CROSS_DRAFT):
        message = f"{CROSS_DRAFT} is not installed: run `specdec-exact models pull {CROSS_DRAFT} --runtime llama.cpp`"
        if os.environ.get("SPECDEC_REQUIRE_REAL_MODELS"):
            pytest.fail(message)
        pytest.skip(message)
    # keep_draft: "auto" leaves out a draft model whose step cannot pay on this CPU (SmolLM2's was 0.53 of a target
    # step on a 2-core Zen 4), and this test is of the drafts it makes across vocabularies, under either k policy
    gen = SpeculativeGenerator(speculative.target, CROSS_DRAFT, k=k, tokenizer=speculative.tokenizer, keep_draft=True)
    assert gen.cross_vocabulary is not None
    drafted = 0
    for prompt, ref in references.items():
        out = gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == ref.token_ids, prompt
        drafted += out.stats.drafted_tokens
        print(f"{CROSS_DRAFT}@{k}: {out.stats.tokens_per_s:.2f} tok/s vs target-only {ref.stats.tokens_per_s:.2f}, "
              f"acceptance {out.stats.acceptance_rate:.0%}, {dict(out.stats.drafter_counts)}")
    assert drafted > 0 or k == "auto"


def test_the_pair_runs_in_a_fraction_of_the_fp32_memory(pair):
    speculative, _ = pair
    assert speculative.runtime is LLAMA_CPP and runtime_of(speculative.draft) is LLAMA_CPP
    # The registry's Q4_K_M files themselves (sha256-verified), not fp32 copies.
    assert speculative.target.path == registry.gguf_file(registry.DEFAULT_TARGET, progress=False)
    assert speculative.draft.path == registry.gguf_file(registry.DEFAULT_DRAFT, progress=False)
    assert speculative.vocab_size == len(speculative.tokenizer)


@pytest.fixture(scope="module")
def long_prompt(pair) -> list[int]:
    """Real code far past 512 tokens: HumanEval prompts, one after another, cut at 1,600 tokens."""
    speculative, _ = pair
    ids = speculative.tokenizer("\n\n".join(human_eval_prompts(20)))["input_ids"]
    assert len(ids) > 1600
    return ids[:1600]


def test_long_prompt_greedy_speculation_equals_target_only(pair, long_prompt):
    speculative, baseline = pair
    reference = baseline.generate(long_prompt, max_new_tokens=NEW_TOKENS)
    out = SpeculativeGenerator(speculative.target, "ngram", k=4, tokenizer=speculative.tokenizer).generate(
        long_prompt, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == reference.token_ids
    assert out.stats.drafted_tokens > 0 and out.stats.narrowed_cycles == 0


def test_verify_passes_at_a_long_context_equal_one_token_passes(pair, long_prompt):
    import torch

    speculative, _ = pair
    target = speculative.target
    widest = target.verify_width(len(long_prompt))
    assert widest >= 3
    ids = torch.tensor([long_prompt])
    prefix = ids.shape[1] - widest
    runner = target.pool().take(speculative.vocab_size)
    runner.forward(ids[:, :prefix], last_only=True)
    single = torch.cat([runner.forward(ids[:, i:i + 1])[0] for i in range(prefix, ids.shape[1])])
    for width in range(2, widest + 1):
        runner.rollback(prefix)
        assert torch.equal(runner.forward(ids[:, prefix:prefix + width])[0], single[:width]), width


def test_target_only_greedy_equals_llama_cpp_pythons_own_loop(pair, long_prompt):
    """The same tokens as llama-cpp-python's `Llama.generate` with the same settings (cache type, flash attention,
    weight layouts, prompts evaluated in the same layout as the rest), short and long prompts."""
    from specdec_exact.runtimes import llamacpp
    from specdec_exact.runtimes.llamacpp.peer import LlamaCppPythonPeer

    speculative, _ = pair
    loaded = speculative.target
    target = llamacpp.LlamaCppModel(loaded.path, loaded.threads, loaded.kv_cache, repack=loaded.repack,
                                    prefill_repack=None)  # llama.cpp's loop has one layout for all
    baseline = SpeculativeGenerator(target, None, tokenizer=speculative.tokenizer)
    cache = llamacpp.KV_CACHE_TYPES[target.kv_cache]
    peer = LlamaCppPythonPeer(str(target.path), dict(n_threads=target.threads, n_threads_batch=target.threads,
                                                     flash_attn=True, type_k=cache, type_v=cache), repack=target.repack,
                               attention_split=target.attention_split)
    try:
        for prompt in [speculative.tokenizer(human_eval_prompts(3)[2])["input_ids"], long_prompt]:
            theirs = peer.generate(prompt, 32, baseline.eos_ids)
            assert baseline.generate(prompt, max_new_tokens=32).token_ids == theirs
    finally:
        peer.close()


def _cpu_has_avx2() -> bool:
    return any(line.startswith("flags") and " avx2" in line for line in open("/proc/cpuinfo"))


def test_the_patched_kernels_verify_eight_tokens_exactly_at_every_calibrated_length(pair):
    """specdec builds llama.cpp with multi-column K-quant kernels (native/llama.cpp-verify-columns.patch): a pass over
    2-16 tokens gives each token the logits of a one-token pass bit for bit, in either weight layout, where llama.cpp's
    own multi-token kernels round differently (exact up to 3 tokens with repacked layouts, 7 without)."""
    if not _cpu_has_avx2():
        pytest.skip("the patched kernels are x86 AVX2 code; other CPUs keep llama.cpp's own")
    from specdec_exact.runtimes import llamacpp

    target = pair[0].target
    assert target.exact_widths == {length: max(llamacpp.CALIBRATION_WIDTHS) for length in target.exact_widths}
    assert target.verify_width(16) == max(llamacpp.CALIBRATION_WIDTHS)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_kernel_plan_gives_each_width_an_exact_kernel_timed_against_llama_cpps_own(pair, role):
    """The calibration timed every candidate at every width, llama.cpp's own kernels among them, and the plan takes
    one that was exact there; under the plan a 16-token pass gives every token its one-token logits."""
    from specdec_exact.runtimes import llamacpp
    from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP, MAX_WIDTH

    model = getattr(pair[0], role)
    found = model.kernel_calibration
    for width, kernel in enumerate(model.kernel_plan.kernels, 1):
        assert LLAMA_CPP.describe() in found["pass_s"][str(width)]
        assert kernel.describe() in found["exact"][str(width)], (width, kernel)
    tokens = llamacpp.probe_tokens(model, 16 + MAX_WIDTH)
    runner = llamacpp.private_runner(model, tokens.shape[1])
    runner.forward(tokens[:, :16], last_only=True)
    single = llamacpp.one_token_logits(runner, tokens[:, 16:])
    runner.rollback(16)
    assert torch.equal(runner.forward(tokens[:, 16:])[0], single)


def test_negative_control_a_plan_of_llama_cpps_own_kernels_switched_in_process_is_caught(pair):
    """The plan is switched at run time, in this process: under llama.cpp's own kernels at every width the same
    16-token pass no longer matches the one-token passes (they round by pass width), so the check above can fail."""
    from specdec_exact.runtimes import llamacpp
    from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP, KernelPlan

    if not _cpu_has_avx2():
        pytest.skip("the patched kernels are x86 AVX2 code")
    target = pair[0].target
    tokens = llamacpp.probe_tokens(target, 32)
    runner = llamacpp.private_runner(target, 32)
    runner.forward(tokens[:, :16], last_only=True)
    single = llamacpp.one_token_logits(runner, tokens[:, 16:])
    plan = target.kernel_plan
    try:
        target._kernel_plan = KernelPlan.uniform(LLAMA_CPP)
        runner.rollback(16)
        own = runner.forward(tokens[:, 16:])[0]
    finally:
        target._kernel_plan = plan
    assert not torch.equal(own, single)
    runner.rollback(16)
    assert torch.equal(runner.forward(tokens[:, 16:])[0], single)  # the plan again: exact


# Run in a fresh process, as llama.cpp reads its environment once: GGML_CPU_MULTI_COLUMN=0 turns the patched kernels
# off, and llama.cpp's own multi-token kernels take the passes again.
_WIDTHS = """
import sys
from specdec_exact import registry
from specdec_exact.runtimes import llamacpp
model = llamacpp.LlamaCppModel(registry.gguf_file(sys.argv[1]), threads=2, repack=sys.argv[2] == "True")
print(llamacpp.measure_exact_widths(model, contexts=(16,))["exact_width"]["16"])
"""


def test_negative_control_the_exactness_check_catches_llama_cpps_own_multi_token_kernels(pair):
    """The calibration (and with it the check above) sees kernels that round by pass width: with the patched kernels
    switched off, passes of 8 tokens of the draft model (4 with repacked layouts) no longer match one-token passes."""
    import subprocess
    import sys

    from specdec_exact.runtimes import llamacpp

    if not _cpu_has_avx2():
        pytest.skip("the patched kernels are x86 AVX2 code")
    draft = pair[0].draft
    env = {**os.environ, "GGML_CPU_MULTI_COLUMN": "0"}
    result = subprocess.run([sys.executable, "-c", _WIDTHS, registry.DEFAULT_DRAFT, str(draft.repack)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) < 8
    widths = llamacpp.measure_exact_widths(draft, contexts=(16,))["exact_width"]
    assert widths == {"16": max(llamacpp.CALIBRATION_WIDTHS)}  # the same file and context, with the patched kernels


# llama.cpp's own kernels (GGML_CPU_MULTI_COLUMN=0): after 40 and after 600 tokens, 8 one-token passes each, and
# after 40 tokens one pass over the same 8 tokens; saved for the parent to compare.
_OWN_KERNELS = """
import sys, torch
from specdec_exact import registry
from specdec_exact.runtimes import llamacpp
layout = {"True": True, "False": False, "None": None}
model = llamacpp.LlamaCppModel(registry.gguf_file(sys.argv[1]), threads=2, repack=layout[sys.argv[2]],
                               prefill_repack=layout[sys.argv[3]], prefill_min_tokens=llamacpp.PREFILL_MIN_TOKENS)
tokens = llamacpp.probe_tokens(model, 600 + 8)
runner = llamacpp.private_runner(model, tokens.shape[1])
found = []
for length in (40, 600):
    runner.rollback(0)
    runner.forward(tokens[:, :length], last_only=True)
    found.append(llamacpp.one_token_logits(runner, tokens[:, length:length + 8]))
runner.rollback(0)
runner.forward(tokens[:, :40], last_only=True)
found.append(runner.forward(tokens[:, 40:48])[0])
torch.save(torch.stack(found), sys.argv[4])
"""


@pytest.mark.parametrize("role", ["target", "draft"])
def test_one_token_passes_equal_llama_cpps_own_kernels_bit_for_bit(pair, role, tmp_path, monkeypatch):
    """The patched kernels take one-token passes too (they prefetch the weights, which llama.cpp's do not): each
    pass must give the logits of llama.cpp's own kernels bit for bit, in the layout the model runs in, so that "exact"
    still means "as plain llama.cpp decodes". The reference runs in a fresh process with the patch switched off; the
    contexts are longer than 16 tokens and go to the prefill layout from 17 tokens in both processes, so both
    prefill them with llama.cpp's own kernels."""
    import subprocess
    import sys

    import torch

    from specdec_exact.runtimes import llamacpp

    if not _cpu_has_avx2():
        pytest.skip("the patched kernels are x86 AVX2 code; other CPUs keep llama.cpp's own")
    model = getattr(pair[0], role)
    monkeypatch.setattr(model, "_prefill_min_tokens", llamacpp.PREFILL_MIN_TOKENS)
    name = registry.DEFAULT_TARGET if role == "target" else registry.DEFAULT_DRAFT
    prefill_layout = None if model.prefill_model is None else model.prefill_model.repack  # prompts: the same layout
    saved = tmp_path / "own.pt"
    result = subprocess.run([sys.executable, "-c", _OWN_KERNELS, name, str(model.repack), str(prefill_layout),
                             str(saved)], env={**os.environ, "GGML_CPU_MULTI_COLUMN": "0"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    one_after_40, one_after_600, wide_after_40 = torch.load(saved)
    tokens = llamacpp.probe_tokens(model, 600 + 8)
    runner = llamacpp.private_runner(model, tokens.shape[1])
    for length, theirs in ((40, one_after_40), (600, one_after_600)):
        runner.rollback(0)
        runner.forward(tokens[:, :length], last_only=True)
        ours = llamacpp.one_token_logits(runner, tokens[:, length:length + 8])
        assert torch.equal(ours, theirs), (length, (ours - theirs).abs().max().item())
    # The comparison can fail: llama.cpp's own 8-token pass over the same tokens rounds differently from its one-token
    # passes (in either layout), and ours gives the one-token logits.
    assert not torch.equal(wide_after_40, one_after_40)
    runner.rollback(0)
    runner.forward(tokens[:, :40], last_only=True)
    assert torch.equal(runner.forward(tokens[:, 40:48])[0], one_after_40)


def test_generate_many_on_the_default_pair_equals_each_prompts_own_output(pair):
    speculative, baseline = pair
    gen = SpeculativeGenerator(speculative.target, speculative.drafter, tokenizer=speculative.tokenizer)
    prompts = human_eval_prompts(4) + ["Summarise: the cat sat on the mat because the mat was warm."]
    together = gen.generate_many(prompts, max_new_tokens=32, chat=True)
    for prompt, out in zip(prompts, together):
        assert out.token_ids == baseline.generate(prompt, max_new_tokens=32, chat=True).token_ids


def concurrent_prompts(generator) -> list[str]:
    """16 real prompts of 40 to 1,000+ tokens (the long one first, so that it decodes beside the others)."""
    from benchmarks import load
    from specdec_exact.bench.workloads import TASKS

    long = "List every person named in these news articles."
    for prompt in TASKS["summarisation"].load():
        if len(generator.encode(long, chat=True)) > 1200:
            break
        long += "\n\n" + prompt.text.split("\n\n", 1)[1]
    return [long, *load.load_prompts(generator, 15, ("code", "summarisation", "maths"), 700)]


@pytest.fixture(scope="module")
def concurrent_references(pair):
    _, baseline = pair
    prompts = concurrent_prompts(baseline)
    return {p: baseline.generate(p, max_new_tokens=CONCURRENT_TOKENS, chat=True).token_ids for p in prompts}


CONCURRENT_TOKENS = 24


@pytest.mark.parametrize("drafting", [True, False], ids=["default-drafter", "target-only"])
def test_concurrent_load_through_the_server_gives_every_request_its_solo_answer(pair, concurrent_references,
                                                                               drafting):
    """8 clients of the OpenAI client, 2 requests each (the second wave takes slots that others left while the rest
    still decode), starting at staggered moments, prompts of 40 to 1,000+ tokens: every answer equals the prompt's
    generate() alone, token for token, with the server's default drafter and without one."""
    from benchmarks import load

    speculative, baseline = pair
    gen = (SpeculativeGenerator(speculative.target, speculative.drafter, tokenizer=speculative.tokenizer)
           if drafting else baseline)
    results = load.run_load(gen, list(concurrent_references), clients=[8], requests=2, max_tokens=CONCURRENT_TOKENS,
                            max_batch=8, stagger=1.5, one_at_a_time=False, references=concurrent_references)
    (row,) = results["rows"]
    assert row["failed"] == 0, row["errors"]
    assert row["identical"] == row["requests"] == 16, row["different"]


def test_negative_control_the_load_comparison_catches_a_batch_that_flips_near_ties(pair, concurrent_references,
                                                                                  monkeypatch):
    """The same load through a target whose fused passes lean towards each row's runner-up token (as a kernel that
    rounds differently would flip a near-tie): the comparison must see answers change."""
    from benchmarks import load

    _, baseline = pair
    exact_forward_many = llamacpp.SlotPool.forward_many

    def leaning(pool, items):
        outputs = exact_forward_many(pool, items)
        for logits in outputs:
            runner_up = logits.topk(2, dim=-1).indices[..., 1:]  # [1, n, 1]
            logits.scatter_add_(-1, runner_up, torch.full(runner_up.shape, 1.5, dtype=logits.dtype))
        return outputs

    monkeypatch.setattr(llamacpp.SlotPool, "forward_many", leaning)
    results = load.run_load(baseline, list(concurrent_references)[:8], clients=[8], requests=1,
                            max_tokens=CONCURRENT_TOKENS, max_batch=8, stagger=1.5, one_at_a_time=False,
                            references=concurrent_references)
    (row,) = results["rows"]
    assert row["failed"] == 0 and row["identical"] < row["requests"]


# --- the prompt cache on the default target: Q4_K/Q6_K kernels, whose passes of other shapes do round differently --

def test_prompt_cache_hits_prefill_cold_logits_and_blocks_from_decode_passes_are_caught(pair, monkeypatch):
    """A hit's logits equal a cold prefill's bit for bit; negative control: a cache whose blocks were computed one
    token per pass (as decoding computes an answer's entries, which llama-server's cache reuses) gives other logits,
    so the comparison would catch a cache that reused them."""
    from specdec_exact.prompt_cache import PromptCache

    speculative, _ = pair
    model, tokenizer = speculative.target, speculative.tokenizer
    first, second = conversation_prompts(tokenizer, 3)[1:]
    good, decoded = PromptCache(2**28), PromptCache(2**28)
    prefill_through(model, first, good)
    with prefills_in_passes_of(monkeypatch, 1):
        prefill_through(model, first, decoded)
    cold, _ = prefill_through(model, second, None)
    warm, reused = prefill_through(model, second, good)
    assert reused >= llamacpp.PREFILL_BLOCK and torch.equal(warm, cold)
    wrong, reused = prefill_through(model, second, decoded)
    assert reused >= llamacpp.PREFILL_BLOCK and not torch.equal(wrong, cold)


def test_a_shared_system_message_is_reused_exactly_and_one_computed_inside_a_longer_pass_is_caught(pair, monkeypatch):
    """Two questions after the template's default system message: the second reuses the first's system message
    (a segment far shorter than a block) and prefills the logits of a cold prefill bit for bit. Negative control: a
    cache whose system message was computed inside the first prompt's one pass (as llama-server's slot reuses a
    prompt's prefix; a pass of 64+ tokens takes ggml's tiled attention) gives other logits."""
    from specdec_exact.prompt_cache import PromptCache

    speculative, _ = pair
    model, tokenizer = speculative.target, speculative.tokenizer
    first, second = ([*tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]]
                     for text in ("Name three colours of the rainbow, say which of them looks the brightest to people, "
                                  "why that is so, and how a camera sensor and a printer each reproduce it; answer "
                                  "in two short paragraphs for a curious ten year old.",
                                  "Write a haiku about a compiler that finds a bug on a Friday evening."))
    parted = next(i for i in range(len(first)) if first[i] != second[i])
    system = max(i for i in range(parted) if first[i] in model.segment_marks)  # where the user's message starts
    assert 0 < system < llamacpp.PREFILL_BLOCK and len(first) >= 64
    good, inside = PromptCache(2**28), PromptCache(2**28)
    prefill_through(model, first, good)
    with prefills_in_passes_of(monkeypatch, llamacpp.BATCH):
        prefill_through(model, first, inside)
    cold, _ = prefill_through(model, second, None)
    warm, reused = prefill_through(model, second, good)
    assert reused == system and torch.equal(warm, cold)
    wrong, reused = prefill_through(model, second, inside)
    assert reused == system and not torch.equal(wrong, cold)


def test_a_cached_answer_prefills_cold_logits_and_an_answer_prefilled_in_one_pass_is_caught(pair, monkeypatch):
    """The default pair generates an answer, which goes into the prompt cache as decoding computed it; the next turn
    reuses it and prefills the logits of a cold prefill bit for bit (whose answer segments run in passes of the exact
    verify width). Negative control: a cold prefill that runs the answer in one pass, as any other message, gives
    other logits: entries from decoding are reusable only because answers are prefilled as decoding computes them."""
    from specdec_exact.runtimes.llamacpp import runner as runner_module

    speculative, _ = pair
    model, tokenizer = speculative.target, speculative.tokenizer
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, "
                                            "iteratively, with a docstring."}]
    answer = speculative.generate(messages, chat=True, max_new_tokens=48)
    messages += [{"role": "assistant", "content": answer.text},
                 {"role": "user", "content": "Now make it return the whole sequence up to n as a list."}]
    tokens = speculative.encode(messages, chat=True)
    question = max(i for i, token in enumerate(tokens[:-3]) if token == model.answer_start[0])
    warm, reused = prefill_through(model, tokens, speculative.prompt_cache)
    assert reused == question  # everything but the new question (and the answer's start)
    cold, _ = prefill_through(model, tokens, None)
    assert torch.equal(warm, cold)
    planned = runner_module.plan_passes
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "plan_passes", lambda tokens, segments, *rest: planned(
            tokens, [(end, False) for end, _ in segments], *rest))
        wrong, _ = prefill_through(model, tokens, None)
    assert not torch.equal(wrong, cold)


def test_a_five_turn_conversation_through_the_server_answers_as_a_server_without_the_cache(pair):
    """The default pair and drafter, greedy, the OpenAI client: each turn's answer in the next turn's history; the
    same requests on a server with no prompt cache give the same answers, token for token."""
    import openai

    from specdec_exact.server.app import create_app

    speculative, _ = pair
    opening = ("You review Python code for a team. Be brief and concrete, and quote the lines you discuss. "
               + human_eval_prompts(3)[2]) * 2
    answers = {}
    for budget in (1024, 0):
        gen = SpeculativeGenerator(speculative.target, speculative.drafter, tokenizer=speculative.tokenizer,
                                   prompt_cache=budget)
        with serve(create_app(gen, "default")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            if budget:
                sent = conversation_requests(client, opening, 5, {"temperature": 0}, max_tokens=24)
                answers[budget] = [answer for _, answer in sent]
            else:  # the very requests the cached server answered
                answers[budget] = [chat(client, messages, {"temperature": 0}, 24) for messages, _ in sent]
    assert sum(answer["cached"] > 0 for answer in answers[1024]) >= 4
    assert all(answer["cached"] == 0 for answer in answers[0])
    assert [a["token_ids"] for a in answers[1024]] == [a["token_ids"] for a in answers[0]]


def test_long_segments_merged_into_shared_passes_prefill_the_logits_of_a_pass_each_and_short_ones_are_caught(
        pair, monkeypatch):
    """A cold prompt whose long segments share passes (as the pass-merging calibration allows) gives the last token's
    logits of one pass per segment, and a warm prompt through the cache those of the cold one. Negative controls: the
    calibration's check fails for passes of 32 tokens (ggml's attention sweeps fewer than 64 query rows one by one),
    and a plan that also sends short segments to the prefill model and merges them gives other logits, which the
    comparison catches."""
    from specdec_exact.prompt_cache import PromptCache
    from specdec_exact.runtimes.llamacpp import calibration
    from specdec_exact.runtimes.llamacpp import runner as runner_module

    speculative, _ = pair
    model, tokenizer = speculative.target, speculative.tokenizer
    there = model.prefill_model or model
    assert calibration.measure_pass_merging(there, candidates=(32,))["merge_from"] is None
    merge_from = model.merges_passes_from
    if merge_from is None:
        pytest.skip("on this machine passes of 64 or 128 tokens give other logits when a prompt is cut otherwise")
    planned = runner_module.plan_passes
    tokens = conversation_prompts(tokenizer, 5)[-1]
    merged = planned(tokens, prefill_segments_of(model, tokens), 0, lambda position: 1, model.prefill_min_tokens,
                     merge_from)
    assert len(merged) < len(planned(tokens, prefill_segments_of(model, tokens), 0, lambda position: 1,
                                     model.prefill_min_tokens, None))  # (this prompt has passes to merge)

    def plan(merge_from):
        return lambda tokens, segments, start, width_at, elsewhere, *_: planned(
            tokens, segments, start, width_at, elsewhere, merge_from)

    cold, _ = prefill_through(model, tokens, None)
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "plan_passes", plan(None))
        alone, _ = prefill_through(model, tokens, None)
    assert torch.equal(cold, alone)
    cache = PromptCache(2**28)
    prefill_through(model, tokens[:len(tokens) * 2 // 3], cache)
    warm, reused = prefill_through(model, tokens, cache)
    assert reused > 0 and torch.equal(warm, cold)
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "plan_passes", plan(16))
        patch.setattr(model, "_prefill_min_tokens", 17)  # (short segments in the prefill model too)
        wrong, _ = prefill_through(model, tokens, None)
    assert not torch.equal(wrong, cold)


def prefill_segments_of(model, tokens: list[int]) -> list[tuple[int, bool]]:
    from specdec_exact.runtimes.llamacpp.context import prefill_segments

    return prefill_segments(tokens, model.segment_marks, model.answer_start)
