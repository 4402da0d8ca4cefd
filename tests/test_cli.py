"""`specdec-exact generate` end to end on a tiny model saved to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec_exact import SpeculativeGenerator
from specdec_exact.cli import main

from conftest import save_tiny_pair


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), "llama")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_matches_the_python_api(model_dirs, capsys):
    target, draft = model_dirs
    code, out, _ = run(capsys, "generate", "--target", str(target), "--draft", str(draft), "--prompt", "def f",
                       "--max-new-tokens", "20", "--k", "3", "--json")
    assert code == 0
    record = json.loads(out)
    assert set(record) >= {"text", "token_ids", "stats"}
    for key in ["target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_accepted_length", "tokens_per_s"]:
        assert key in record["stats"]
    expected = SpeculativeGenerator(str(target), None).generate("def f", max_new_tokens=20)
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text


def test_draft_none_is_target_only(model_dirs, capsys):
    code, out, _ = run(capsys, "generate", "--target", str(model_dirs[0]), "--draft", "none", "--prompt", "ab",
                       "--max-new-tokens", "8", "--json")
    assert code == 0 and json.loads(out)["stats"]["drafted_tokens"] == 0


def test_text_output_has_a_summary_and_the_compare_line(model_dirs, capsys, trusted_torch_widths):
    target, draft = model_dirs
    code, out, _ = run(capsys, "generate", "--target", str(target), "--draft", str(draft), "--prompt", "x = ",
                       "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "3", "--compare")
    assert code == 0
    assert "tokens/s" in out and "acceptance rate" in out and "mean accepted length" in out
    assert "speed-up" in out and "each run 3 times in turn (medians)" in out


@pytest.mark.parametrize("rounds", [None, 2])
def test_compare_runs_each_configuration_in_turn_and_reports_medians(model_dirs, capsys, monkeypatch, rounds):
    """--compare times specdec and target-only COMPARE_ROUNDS (or --compare-rounds) times each, alternating, and
    reports each one's median (a machine whose speed drifts weighs on both alike), each round as a tenant of its own;
    --json carries the same figures."""
    from specdec_exact import cli
    from specdec_exact.generator import SpeculativeGenerator

    order, real = [], SpeculativeGenerator.generate

    def generate(self, prompt, **settings):
        result = real(self, prompt, **settings)
        if settings.get("max_new_tokens", 0) > 2:  # (not the warm-ups)
            order.append(("target-only" if self.drafter.name == "none" else "specdec", settings.get("tenant")))
        return result

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    flags = [] if rounds is None else ["--compare-rounds", str(rounds)]
    code, out, _ = run(capsys, "generate", "--target", str(model_dirs[0]), "--draft", "ngram", "--prompt", "ab ab",
                       "--max-new-tokens", "8", "--compare", "--json", *flags)
    record = json.loads(out)
    compared, baseline = record["compared"], record["baseline"]
    expected_rounds = cli.COMPARE_ROUNDS if rounds is None else rounds
    assert cli.COMPARE_ROUNDS == 3
    assert code == 0 and compared["rounds"] == expected_rounds and baseline["identical"]
    # each round a tenant of its own: its lookup cannot draft an earlier round's answer
    assert order == [("specdec", None)] + [(name, f"compare {i}") for i in range(expected_rounds)
                                           for name in ("specdec", "target-only")]
    assert compared["tokens_per_s"] > 0 and baseline["tokens_per_s"] > 0
    assert baseline["speedup"] == pytest.approx(compared["tokens_per_s"] / baseline["tokens_per_s"])


def test_the_answer_is_printed_as_it_comes_before_the_comparison_runs(model_dirs, capsys, monkeypatch):
    """Without --json the answer streams to stdout chunk by chunk (flushed, so a pipe sees it too) and is whole before
    --compare's timed runs start; its text is the Python API's."""
    from specdec_exact.generator import SpeculativeGenerator

    expected = SpeculativeGenerator(str(model_dirs[0]), None).generate("ab ab", max_new_tokens=8)
    printed, real = [], SpeculativeGenerator.generate

    def generate(self, prompt, **settings):
        printed.append(capsys.readouterr().out)  # what stdout held before this run
        return real(self, prompt, **settings)

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    code, out, _ = run(capsys, "generate", "--target", str(model_dirs[0]), "--draft", "none", "--prompt", "ab ab",
                       "--max-new-tokens", "8", "--compare", "--compare-rounds", "1")
    assert code == 0 and expected.text and printed[0] == expected.text + "\n"
    assert "speed-up" in out


def test_a_float32_target_that_verifies_one_token_at_a_time_says_so(model_dirs, capsys):
    """The tiny float32 target's passes over several tokens are not bit-exact: nothing is drafted, and the summary
    says why instead of blaming the drafter."""
    target, draft = model_dirs
    code, out, _ = run(capsys, "generate", "--target", str(target), "--draft", str(draft), "--prompt", "x = ",
                       "--max-new-tokens", "8")
    assert code == 0 and "verified alone" in out


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "k (draft tokens per cycle) must be >= 1"),
    (["--k", "two"], "k must be a positive integer or 'auto'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "-3"], "max_new_tokens must be >= 0"),
    (["--prompt", ""], "prompt is empty"),
])
def test_bad_input_exits_2_with_a_clear_message(model_dirs, capsys, flags, message):
    args = ["generate", "--target", str(model_dirs[0]), "--draft", "none", "--prompt", "ab"] + flags
    code, _, err = run(capsys, *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_a_prompt_file_is_read_as_the_prompt(model_dirs, capsys, tmp_path):
    """--prompt-file FILE generates what --prompt with the file's text does; it and --prompt exclude each other."""
    text = "def f(x):\n    return x\n"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    common = ["generate", "--target", str(model_dirs[0]), "--draft", "none", "--max-new-tokens", "6", "--json"]
    _, from_file, _ = run(capsys, *common, "--prompt-file", str(tmp_path / "prompt.txt"))
    _, given, _ = run(capsys, *common, "--prompt", text)
    _, other, _ = run(capsys, *common, "--prompt", "x")
    assert json.loads(from_file)["token_ids"] == json.loads(given)["token_ids"] != json.loads(other)["token_ids"]
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--prompt", "x", "--prompt-file", str(tmp_path / "prompt.txt")])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--prompt-file", "/nonexistent/prompt.txt"], "can't open '/nonexistent/prompt.txt'"),
    (["--compare", "--compare-rounds", "0"], "must be at least 1, not 0"),
])
def test_bad_flags_exit_2_with_argparse_s_message(model_dirs, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", str(model_dirs[0]), "--draft", "none", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_unknown_model_names_the_choices(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nowhere"), "--draft", "none")
    assert code == 2 and "unknown model" in err and "qwen2.5-coder-1.5b-instruct" in err


def test_console_script_runs(model_dirs):
    done = subprocess.run([sys.executable, "-m", "specdec_exact.cli", "generate", "--target", str(model_dirs[0]),
                           "--draft", "none", "--prompt", "ab", "--max-new-tokens", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) <= 4


# PyPI's `specdec` (0.2.0) is an unrelated project with a top-level `specdec` package and a `specdec` command: an
# install of one into the other's environment overwrote them. This distribution installs neither name.
def test_the_distribution_installs_no_package_or_command_of_the_index_s_specdec():
    import importlib.metadata
    import importlib.util

    from specdec_exact import DISTRIBUTION

    installed = importlib.metadata.distribution(DISTRIBUTION)
    commands = {entry.name for entry in installed.entry_points if entry.group == "console_scripts"}
    packages = set(installed.read_text("top_level.txt").split())
    assert commands == {"specdec-exact"} and packages == {"specdec_exact"}
    assert importlib.util.find_spec("specdec_exact").origin.endswith("specdec_exact/__init__.py")
