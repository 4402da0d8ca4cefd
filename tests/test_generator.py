"""The public API: SpeculativeGenerator on tiny models with a character tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec_exact import SpeculativeGenerator
from specdec_exact.vocabulary import IncompatibleVocabulary
from specdec_exact.runtimes.pytorch import RollbackUnsupported, TorchRunner

from conftest import char_tokenizer, close_draft, tiny_model

VOCAB = 60  # the character tokenizer's size


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", seed=0, vocab_size=VOCAB)
    return target, close_draft(target)


@pytest.fixture(scope="module")
def gen(pair, tokenizer):
    target, draft = pair
    return SpeculativeGenerator(target, draft, k=3, tokenizer=tokenizer, draft_tokenizer=tokenizer)


@pytest.fixture(scope="module")
def baseline(gen):
    return SpeculativeGenerator(gen.target, None, tokenizer=gen.tokenizer)


def test_loaded_models_are_shared_not_copied(gen, baseline, pair):
    assert gen.target is pair[0] and gen.draft is pair[1]
    assert baseline.target is gen.target and baseline.draft is None


def test_greedy_text_equals_target_only(gen, baseline):
    for prompt in ["def f(x):", "hello world", "a"]:
        out, ref = gen.generate(prompt, max_new_tokens=30), baseline.generate(prompt, max_new_tokens=30)
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text == gen.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert len(out.from_draft) == len(out.token_ids)
        assert out.stats.drafted_tokens > 0 and ref.stats.drafted_tokens == 0


def test_stats_carry_the_documented_keys(gen):
    stats = gen.generate("abc", max_new_tokens=12).stats.to_dict()
    for key in ["target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_accepted_length", "tokens_per_s", "emitted_per_cycle", "acceptance_by_position", "time_s"]:
        assert key in stats
    assert stats["new_tokens"] <= sum(int(n) * c for n, c in stats["emitted_per_cycle"].items())
    assert stats["target_calls"] == stats["cycles"] + 1  # the prefill, then one call per cycle


def test_same_seed_same_sample_different_seeds_differ(gen):
    runs = [gen.generate("abc", max_new_tokens=20, temperature=1.0, seed=s).token_ids for s in (1, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2] or runs[0] != runs[3]


def test_a_seeded_sample_does_not_depend_on_what_the_generator_served_before(pair, tokenizer, monkeypatch):
    """Suffix lookup remembers earlier requests, and what a cycle drafts decides how a sample uses its random stream:
    a seeded sample drafts with a drafter of its own, so the same prompt and seed give the same sample after other
    requests (and a greedy request still uses the history). Negative control: sharing the drafter's history, the
    samples differ."""
    from specdec_exact.requests import Request

    target, _ = pair
    gen = SpeculativeGenerator(target, "suffix", k=4, tokenizer=tokenizer)
    prompt, settings = "abcabcabc abcabc", dict(max_new_tokens=40, temperature=1.0, seed=7)

    def samples():
        runs = set()
        for filler in ("abcabc abc", "cab cab abcab", "ab ab ab abc"):
            gen.generate(filler + prompt, max_new_tokens=30)  # greedy requests grow the lookup's history
            runs.add(tuple(gen.generate(prompt, **settings).token_ids))
        return runs

    assert len(samples()) == 1
    assert len(gen.drafter.history) >= 2  # the greedy requests did grow the shared history
    monkeypatch.setattr(Request, "seeded_sample", property(lambda self: False))
    assert len(samples()) > 1


def test_stream_yields_the_same_text_and_tokens_as_generate(gen):
    settings = dict(max_new_tokens=25, temperature=0.8, top_p=0.9, seed=5)
    chunks = list(gen.stream("xyz", **settings))
    out = gen.generate("xyz", **settings)
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert chunks[-1].finish_reason == out.finish_reason and chunks[-1].stats is not None


def test_stop_string_cuts_text_and_tokens(gen, baseline):
    full = baseline.generate("hello", max_new_tokens=40)
    assert len(full.text) > 10
    stop = full.text[5:7]
    first = full.text.find(stop)
    out = gen.generate("hello", max_new_tokens=40, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[:first]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert gen.tokenizer.decode(out.token_ids).endswith(stop)  # the tokens end with the stop string itself
    streamed = "".join(c.text for c in gen.stream("hello", max_new_tokens=40, stop=[stop]))
    assert streamed == out.text


def test_eos_ends_generation_and_is_not_returned(pair, tokenizer):
    target = pair[0]
    reference = SpeculativeGenerator(target, None, tokenizer=tokenizer).generate("q", max_new_tokens=20)
    eos_char = reference.text[4]
    eos_tokenizer = char_tokenizer()
    eos_tokenizer.eos_token = eos_char  # make a character the target emits mid-run the end-of-sequence token
    out = SpeculativeGenerator(target, target, k=4, tokenizer=eos_tokenizer, draft_tokenizer=eos_tokenizer).generate(
        "q", max_new_tokens=20)
    assert out.finish_reason == "stop"
    assert out.token_ids == reference.token_ids[: reference.text.index(eos_char)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt is empty"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(k=0), "k (draft tokens per cycle)"),
    (dict(prompt="a" * 300), "context"),
])
def test_bad_input_gets_a_clear_error(gen, kwargs, message):
    settings = dict(prompt="abc", max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gen.generate(settings.pop("prompt"), **settings)


def test_k_below_one_refused_at_construction(pair):
    with pytest.raises(ValueError, match="k"):
        SpeculativeGenerator(pair[0], pair[1], k=0)


def test_vocabulary_size_mismatch_is_refused(pair):
    with pytest.raises(IncompatibleVocabulary, match=f"target vocabulary has {VOCAB} tokens, draft has 70"):
        SpeculativeGenerator(pair[0], tiny_model("qwen2", vocab_size=70))


def test_tokenizer_mismatch_names_the_first_differing_token(pair, tokenizer):
    other = char_tokenizer()
    vocab = dict(tokenizer.get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    from tokenizers import models
    other.backend_tokenizer.model = models.WordLevel(vocab, unk_token="<eos>")
    with pytest.raises(IncompatibleVocabulary, match="first difference at id 1: target 'a' vs draft 'b'"):
        SpeculativeGenerator(pair[0], pair[1], tokenizer=tokenizer, draft_tokenizer=other)


def test_model_whose_cache_cannot_roll_back_is_refused():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    sliding = Qwen2ForCausalLM(config)
    with pytest.raises(RollbackUnsupported, match="cannot be rolled back"):
        SpeculativeGenerator(sliding, None)


def test_token_id_prompts_work_without_a_tokenizer(pair):
    gen = SpeculativeGenerator(pair[0], pair[1], k=2)
    out = gen.generate([1, 2, 3], max_new_tokens=8)
    assert len(out.token_ids) == 8 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        gen.generate("text", max_new_tokens=3)


def test_int8_draft_keeps_greedy_output_identical(tmp_path, tokenizer, trusted_torch_widths):
    target = tiny_model("llama", seed=0, vocab_size=VOCAB).float()
    target.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    gen = SpeculativeGenerator(target, str(tmp_path / "draft"), k=4, tokenizer=tokenizer, draft_quantization="int8")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    assert isinstance(gen.draft.get_output_embeddings(), DynamicQuantizedLinear)  # the cheaper int8: it only drafts
    baseline = SpeculativeGenerator(target, None, tokenizer=tokenizer)
    for prompt in ["abc", "def g(y):"]:
        out = gen.generate(prompt, max_new_tokens=24)
        assert out.token_ids == baseline.generate(prompt, max_new_tokens=24).token_ids
        assert out.stats.acceptance_rate > 0.5  # the int8 copy of the target still agrees with it mostly


def test_quantizing_a_passed_in_model_is_refused(pair):
    with pytest.raises(ValueError, match="quantization applies to models that specdec loads"):
        SpeculativeGenerator(pair[0], None, target_quantization="int8")


def one_at_a_time_vs_together(model, ids):
    from specdec_exact.runtimes.pytorch import TorchRunner

    together = TorchRunner(model, VOCAB).forward(ids)[0]
    one = TorchRunner(model, VOCAB)
    alone = torch.cat([one.forward(ids[:, i:i + 1])[0] for i in range(ids.shape[1])])
    return together, alone


def test_int8_passes_reproduce_one_token_passes_bit_for_bit_and_torch_dynamic_int8_does_not():
    """specdec's int8 (rowwise activations and attention) keeps the rows of a pass independent, so verification of an
    int8 target is exact; torch's own dynamic int8 quantizes a pass with one scale (the negative control)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    from specdec_exact.models import quantize_int8

    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 1, 4]])
    for arch in ("llama", "qwen2"):
        model = quantize_int8(tiny_model(arch, seed=0, vocab_size=VOCAB).float())
        together, alone = one_at_a_time_vs_together(model, ids)
        assert torch.equal(together, alone), arch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_int8 = quantize_dynamic(tiny_model("llama", seed=0, vocab_size=VOCAB).float(), {torch.nn.Linear},
                                      dtype=torch.qint8)
    together, alone = one_at_a_time_vs_together(torch_int8, ids)
    assert not torch.equal(together, alone)
    assert TorchRunner(torch_int8, VOCAB).verify_width(0) == 1  # such a model is verified one token at a time
    gen = SpeculativeGenerator(torch_int8, torch_int8, k=4)
    assert gen.generate([1, 2, 3], max_new_tokens=8).stats.drafted_tokens == 0


def test_int8_target_speculation_equals_int8_target_only(tmp_path, tokenizer):
    target = tiny_model("llama", seed=0, vocab_size=VOCAB).float()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    gen = SpeculativeGenerator(str(tmp_path / "target"), str(tmp_path / "target"), k=4, tokenizer=tokenizer,
                               target_quantization="int8", draft_quantization="int8")
    assert TorchRunner(gen.target, gen.vocab_size).verify_width(0) == 16  # rows independent: every width exact
    baseline = SpeculativeGenerator(gen.target, None, tokenizer=tokenizer)
    for prompt in ["def g(y):", "abc abc abc"]:
        out = gen.generate(prompt, max_new_tokens=16)
        assert out.token_ids == baseline.generate(prompt, max_new_tokens=16).token_ids
        assert out.stats.acceptance_rate > 0.5  # the draft: the same weights, torch's per-pass int8


# --- stop strings at every position of a cycle, for every drafter ---------------------------------------------------

CYCLE = "abcdefg 123\n"


@pytest.fixture(scope="module")
def cycling(tokenizer):
    """Generators of every drafter over a target whose output repeats, so every drafter gets long accepted runs."""
    from specdec_exact.drafters import HybridDrafter, NgramDrafter, TargetInfo, model_drafter

    from conftest import cycling_model

    target = cycling_model(CYCLE)
    draft = close_draft(target)
    info = TargetInfo(target, tokenizer, VOCAB, torch.float64)
    drafters = {"draft model": draft, "ngram": "ngram", "self:1": "self:1",
                "hybrid": HybridDrafter(NgramDrafter(), model_drafter(draft, info, tokenizer))}
    gens = {name: SpeculativeGenerator(target, spec, k=4, tokenizer=tokenizer, draft_tokenizer=tokenizer)
            for name, spec in drafters.items()}
    return SpeculativeGenerator(target, None, tokenizer=tokenizer), gens


def stop_ends(cycle_lengths: list[int]) -> dict[str, int]:
    """Where a stop string should end (tokens from the start of the output) to hit each place in a cycle."""
    ends, start = {}, 0
    for n in cycle_lengths:
        if n >= 3 and start > 0:
            ends.setdefault("first token of a cycle, the stop string spanning two cycles", start + 1)
            ends.setdefault("middle token of a cycle", start + n // 2 + 1)
            ends.setdefault("last token of a cycle", start + n)
        start += n
    return ends


def first_ending_at(text: str, end: int) -> str:
    """The shortest piece of text ending at `end` whose first occurrence ends there."""
    return next(text[end - n:end] for n in range(1, end + 1) if text.find(text[end - n:end]) == end - n)


@pytest.mark.parametrize("drafter", ["draft model", "ngram", "self:1", "hybrid"])
def test_stop_string_ending_anywhere_in_a_cycle_ends_generation_there(cycling, drafter, trusted_torch_widths):
    baseline, gens = cycling
    gen, prompt = gens[drafter], "hello"
    full = baseline.generate(prompt, max_new_tokens=60)
    cycles = [len(chunk.token_ids) for chunk in gen.stream(prompt, max_new_tokens=60)]
    ends = stop_ends(cycles)
    assert len(ends) == 3, f"{drafter} never accepted a run of 2+ draft tokens: {cycles}"
    for place, end in ends.items():
        stop = first_ending_at(full.text, end)
        out = gen.generate(prompt, max_new_tokens=60, stop=[stop])
        chunks = list(gen.stream(prompt, max_new_tokens=60, stop=[stop]))
        assert out.finish_reason == chunks[-1].finish_reason == "stop", place
        assert out.text == "".join(c.text for c in chunks) == full.text[:full.text.find(stop)], place
        assert out.token_ids == full.token_ids[:end], place  # the tokens run through the stop string, no further
        assert out.stats.new_tokens == end, place


def test_a_stop_string_that_recurs_stops_at_its_first_occurrence(cycling):
    baseline, gens = cycling
    for stop in ["\n", " 1", "3\na"]:
        out = gens["ngram"].generate("hello", max_new_tokens=60, stop=[stop])
        reference = baseline.generate("hello", max_new_tokens=60).text
        assert (out.text, out.finish_reason) == (reference[:reference.find(stop)], "stop"), stop


# --- a seed fixes the sample whatever the k policy ------------------------------------------------------------------


class JitteryClock:
    """perf_counter with random steps: wall-clock times that differ from run to run, as on a busy machine."""

    def __init__(self):
        self.now, self.random = 0.0, __import__("random").Random()

    def perf_counter(self) -> float:
        self.now += self.random.uniform(1e-4, 1.0)
        return self.now


def test_the_same_seed_gives_the_same_sample_under_k_auto(gen, monkeypatch):
    import specdec_exact.batching
    import specdec_exact.engine

    monkeypatch.setattr(specdec_exact.engine, "time", JitteryClock())
    monkeypatch.setattr(specdec_exact.batching, "time", JitteryClock())
    settings = dict(max_new_tokens=40, temperature=0.8, seed=3, k="auto")
    runs = {tuple(gen.generate("abc", **settings).token_ids) for _ in range(6)}
    assert len(runs) == 1


def test_negative_control_a_clock_driven_k_changes_the_sample(gen, monkeypatch):
    """What the test above guards against: k chosen from wall-clock times consumes the random stream differently."""
    import specdec_exact.batching
    import specdec_exact.engine
    from specdec_exact.adaptive import make_k_policy

    monkeypatch.setattr(specdec_exact.engine, "time", JitteryClock())
    monkeypatch.setattr(specdec_exact.batching, "time", JitteryClock())
    monkeypatch.setattr(specdec_exact.batching, "make_k_policy", lambda k, timed, **priors: make_k_policy(k, **priors))
    settings = dict(max_new_tokens=40, temperature=0.8, seed=3, k="auto")
    runs = {tuple(gen.generate("abc", **settings).token_ids) for _ in range(6)}
    assert len(runs) > 1


# --- several prompts at once (generate_many) -------------------------------------------------------------------------

MANY = ["def f(x):", "hello world", "a", "abcabcabc", "xyz xyz", "the cat sat on the mat"]


def test_generate_many_gives_each_prompt_its_solo_greedy_output(gen, baseline):
    """Mixed prompts, lengths and finish reasons (token budget, stop string) in one batch: each equals generate()."""
    for settings in [dict(max_new_tokens=25), dict(max_new_tokens=40, stop=["a", "x "])]:
        together = gen.generate_many(MANY, **settings)
        for prompt, out in zip(MANY, together):
            alone = baseline.generate(prompt, **settings)
            assert (out.token_ids, out.text, out.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert any(out.finish_reason == "stop" for out in together) and sum(o.stats.drafted_tokens for o in together) > 0


def test_generate_many_seeded_sample_does_not_depend_on_the_rest_of_the_batch(gen):
    settings = dict(max_new_tokens=20, temperature=1.0, top_p=0.9)
    together = gen.generate_many(MANY, seed=5, **settings)
    for i, prompt in enumerate(MANY):
        alone = gen.generate(prompt, seed=5 + i, **settings)
        assert together[i].token_ids == alone.token_ids
    assert len({tuple(out.token_ids) for out in together}) > 1


def test_generate_many_edge_cases(gen):
    assert gen.generate_many([]) == []
    out = gen.generate_many(["abc", "de"], max_new_tokens=0)
    assert [o.token_ids for o in out] == [[], []] and [o.finish_reason for o in out] == ["length", "length"]
    with pytest.raises(ValueError, match="empty"):
        gen.generate_many(["abc", ""])
