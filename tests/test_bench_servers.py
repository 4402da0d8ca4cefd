"""The lab's server benchmarks (`python -m benchmarks servers`, conversation, interleave) without llama-server or real
models: the figures on synthetic records, the prompt file, the server-process wrapper, and whole runs against a stand-in
OpenAI server (a small HTTP server in a subprocess)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import servers
from benchmarks.__main__ import main
from benchmarks.harness import Server
from benchmarks.servers import REFERENCE, Config
from specdec_exact import llama_server
from specdec_exact.llama_server import ServerError, ServerProcess

# A stand-in for both llama-server and specdec-exact serve: answers /health, /v1/models and greedy chat completions with
# "<tag> " followed by the prompt's first words (one token each), token ids when asked, and /v1/specdec/plan when
# started with a plan. argv: PORT TAG [PLAN]
FAKE_SERVER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, tag = int(sys.argv[1]), sys.argv[2]
    plan = sys.argv[3] if len(sys.argv) > 3 else None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": "fake-" + tag, "object": "model"}]})
            elif self.path == "/v1/specdec/plan" and plan:
                self.reply(200, {"plan": plan})
            else:
                self.reply(404, {"error": {"message": "no such route"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "fake-" + tag and body["temperature"] == 0 and body["stream"]
            words = [tag.split("-")[0], *body["messages"][-1]["content"].split()[: body["max_tokens"] - 1]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def event(choices, usage=None):
                chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                         "choices": choices, "usage": usage}
                self.wfile.write(("data: " + json.dumps(chunk) + "\\n\\n").encode())

            for i, word in enumerate(words):  # one token a chunk, as the servers stream them
                choice = {"index": 0, "delta": {"content": word if i == 0 else " " + word},
                          "finish_reason": "length" if i == len(words) - 1 else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [i]
                event([choice])
            if body.get("stream_options", {}).get("include_usage"):
                event([], {"prompt_tokens": 7, "completion_tokens": len(words), "total_tokens": 7 + len(words)})
            self.wfile.write(b"data: [DONE]\\n\\n")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    """The stand-in servers do nothing after an answer: no pause after each request (harness.SETTLE_S)."""
    from benchmarks import harness

    monkeypatch.setattr(harness, "SETTLE_S", 0.0)


@pytest.fixture
def fake(tmp_path) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def fake_argv(script: Path, tag: str, *plan: str) -> tuple[str, ...]:
    return (sys.executable, str(script), llama_server.PORT, tag, *plan)


# ---- the prompts and the schedule


def test_prompt_file_has_two_prompts_of_each_of_six_kinds_and_a_separate_warm_up():
    prompts, warmup = servers.load_prompts()
    assert [p["kind"] for p in prompts] == [kind for kind in servers.KINDS for _ in range(2)]
    assert len(servers.KINDS) == 6
    assert len({p["id"] for p in prompts}) == 12 and warmup["id"] not in {p["id"] for p in prompts}
    assert warmup["prompt"] not in {p["prompt"] for p in prompts}
    for p in prompts:
        assert set(p) == {"kind", "id", "prompt"} and len(p["prompt"].split()) >= 15, p["id"]
    for p in prompts[:2]:  # code editing: a ~30-line function to copy back
        code = p["prompt"].split("```python\n")[1].split("```")[0]
        assert len(code.splitlines()) >= 25
    assert servers.load_prompts(("chat", "maths"))[0] == [p for p in prompts if p["kind"] in ("chat", "maths")]


def test_schedule_has_every_server_answer_every_prompt_in_a_rotating_order():
    prompts = [{"id": str(i)} for i in range(4)]
    turns = servers.schedule(prompts, ["a", "b", "c"], rounds=2)
    assert [(r, p["id"]) for r, p, _ in turns] == [(r, str(i)) for r in range(2) for i in range(4)]
    assert all(sorted(order) == ["a", "b", "c"] for _, _, order in turns)
    assert [order[0] for _, _, order in turns] == ["a", "b", "c", "a", "b", "c", "a", "b"]


# ---- the figures


def record(server, kind, tokens, seconds, text="t", prompt_id=None, round_=0, **extra):
    return {"server": server, "kind": kind, "prompt_id": prompt_id or kind, "round": round_, "prompt_tokens": 10,
            "completion_tokens": tokens, "wall_s": seconds, "tokens_per_s": tokens / seconds, "text": text, **extra}


def synthetic() -> dict:
    records = [
        # llama-a is the faster llama-server on chat, llama-b on maths and pooled
        record("llama-a", "chat", 100, 10), record("llama-a", "maths", 100, 20),
        record("llama-b", "chat", 80, 10), record("llama-b", "maths", 120, 10),
        # pooled over a kind's requests: 30 tokens / 2 s + 30 / 1 s -> 60 / 3 = 20, not the mean rate (22.5)
        # c2: the same text from other tokens, which only a comparison of token ids finds
        record("specdec", "chat", 30, 2, prompt_id="c1", token_ids=[1, 2]),
        record("specdec", "chat", 30, 1, prompt_id="c2", token_ids=[1, 3]),
        record("specdec", "maths", 240, 10, text="different"),
        {"server": "specdec", "kind": "maths", "prompt_id": "m2", "round": 0, "error": "APIError: boom"},
        record(REFERENCE, "chat", 50, 10, prompt_id="c1", token_ids=[1, 2]),
        record(REFERENCE, "chat", 50, 10, prompt_id="c2", token_ids=[1, 2]),
        record(REFERENCE, "maths", 100, 10),
    ]
    info = {"command": ["x"], "startup_s": 1.0, "kernel_plan": None}
    return {"servers": {"llama-a": {**info, "baseline": True}, "llama-b": {**info, "baseline": True},
                        "specdec": {**info, "baseline": False}, REFERENCE: {**info, "baseline": False}},
            "records": records}


def test_summary_pools_tokens_over_seconds_and_compares_with_the_best_llama_server_per_kind():
    s = servers.summarise(synthetic())
    rate, best, ratio = s["tokens_per_s"], s["best"], s["vs_best"]
    assert s["kinds"] == ["chat", "maths"] and s["baselines"] == ["llama-a", "llama-b"]
    assert rate["specdec"]["chat"] == pytest.approx(20.0)
    assert rate["specdec"]["all"] == pytest.approx(300 / 13)  # the failed request counts nowhere
    assert rate["llama-a"]["all"] == pytest.approx(200 / 30) and rate["llama-b"]["all"] == pytest.approx(10.0)
    assert best == {"chat": "llama-a", "maths": "llama-b", "all": "llama-b"}
    assert ratio["specdec"]["chat"] == pytest.approx(20 / 10)
    assert ratio["specdec"]["maths"] == pytest.approx(24 / 12)
    assert ratio["specdec"]["all"] == pytest.approx((300 / 13) / 10)
    assert ratio[REFERENCE]["all"] == pytest.approx((200 / 30) / 10)
    assert "llama-a" not in ratio
    assert s["same_text"]["specdec"] == {"same": 2, "compared": 3}
    assert s["same_text"]["llama-a"] == {"same": 1, "compared": 1}  # only its maths prompt has a reference answer
    assert s["same_tokens"] == {"specdec": {"same": 1, "compared": 2}}  # where both gave token ids
    assert s["counts"]["specdec"] == {"requests": 4, "failed": 1, "completion_tokens": 300, "wall_s": 13,
                                      "prompt_tokens_mean": 10, "decode_tokens_per_s": None,
                                      "first_token_s_median": None}  # not streamed: no first token to time


def test_the_decode_rate_leaves_out_the_first_token_and_the_time_to_it():
    """30 tokens in 4 s, the first after 1 s, and 11 in 3 s, the first after 2: (29 + 10) / (3 + 1) tokens/s, not
    41 / 7 (which a slow prefill drags down)."""
    records = [record("s", "chat", 30, 4, first_token_s=1.0), record("s", "chat", 11, 3, first_token_s=2.0),
               record("s", "chat", 1, 1, first_token_s=0.5)]  # a one-token answer has no decode time
    assert servers._decode_rate(records) == pytest.approx(39 / 4)
    assert servers._decode_rate([record("s", "chat", 5, 1)]) is None


def test_report_shows_the_ratios_the_best_configurations_and_the_identity_count():
    results = {**synthetic(), "command": "python -m benchmarks servers", "versions": {"llama-cpp-python": "0.3.36"},
               "machine": {"cpu": "cpu", "cores": 2, "load_average_at_start": [1.0, 1.0, 1.0]},
               "settings": {"max_tokens": 32, "threads": 2, "rounds": 1, "prompts": 4}}
    text = servers.report(results)
    assert "**specdec and specdec-target-only: 1/2 answers with identical token ids.**" in text  # (of those with ids)
    assert "| specdec | 3/4 | 300 | 13.0 | 10 | 20.00 | 24.00 | 23.08 | 2.31x |" in text
    assert "| best llama-server | llama-a | llama-b | llama-b |" in text
    assert "Errors: APIError: boom" in text


def test_a_report_of_specdecs_servers_alone_says_no_llama_server_ran():
    """`--servers specdec,specdec-target-only` runs no llama-server: its results hold none, and the report says so
    (it used to fail on reading the missing binary's path)."""
    synthetic_results = synthetic()
    records = [r for r in synthetic_results["records"] if r["server"] in ("specdec", REFERENCE)]
    results = {"servers": {name: synthetic_results["servers"][name] for name in ("specdec", REFERENCE)},
               "records": records, "command": "python -m benchmarks servers --servers specdec,specdec-target-only",
               "versions": {"llama-cpp-python": "0.3.36"}, "llama_server": None,
               "machine": {"cpu": "cpu", "cores": 2, "load_average_at_start": [1.0, 1.0, 1.0]},
               "settings": {"max_tokens": 32, "threads": 2, "rounds": 1, "prompts": 4}}
    text = servers.report(results)
    assert "no llama-server in this run" in text
    assert "**specdec and specdec-target-only: 1/2 answers with identical token ids.**" in text


# ---- the server processes


def test_a_server_that_exits_at_once_fails_with_its_status_and_output(tmp_path):
    server = Server("quitter", (sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"))
    with pytest.raises(ServerError, match=r"quitter exited with status 3(.|\n)*no model here"):
        with ServerProcess(server, tmp_path / "quitter.log", startup_timeout=30):
            pass


# A stand-in for llama-server on a CPU where its default crashes: killed by SIGSEGV unless started with --no-repack,
# then the stand-in server itself.
CRASHES_WITHOUT_FALLBACK = textwrap.dedent('''
    import os, runpy, signal, sys
    if "--no-repack" not in sys.argv:
        print("llama threadpool init", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.argv = [sys.argv[1], *[a for a in sys.argv[2:] if a != "--no-repack"]]
    runpy.run_path(sys.argv[0], run_name="__main__")
''')


def test_a_server_that_crashes_at_startup_is_started_again_with_its_fallback_and_says_so(fake, tmp_path):
    wrapper = tmp_path / "crashes.py"
    wrapper.write_text(CRASHES_WITHOUT_FALLBACK)
    argv = (sys.executable, str(wrapper), str(fake), llama_server.PORT, "llama-a")
    with ServerProcess(Server("llama-a", argv, baseline=True, fallback=servers.LLAMA_SERVER_FALLBACK),
                       tmp_path / "a.log", startup_timeout=60) as proc:
        assert proc.get_json("/v1/models")["data"][0]["id"] == "fake-llama-a"
        assert proc.argv[-1] == "--no-repack"
        assert "crashed at startup (signal 11)" in proc.fallback and "--no-repack" in proc.fallback
    # without a fallback the crash is the run's error, and a server that merely exits is not started again
    with pytest.raises(ServerError, match="exited with status -11"):
        with ServerProcess(Server("llama-a", argv, baseline=True), tmp_path / "b.log", startup_timeout=60):
            pass
    quitter = Server("quitter", (sys.executable, "-c", "import sys; sys.exit(3)"), fallback=("--no-repack",))
    with pytest.raises(ServerError, match="exited with status 3"):
        with ServerProcess(quitter, tmp_path / "c.log", startup_timeout=30):
            pass
    # every llama-server configuration of the registry has the fallback; specdec's servers none
    setup = servers.Setup(Path("llama-server"), "a.gguf", "b.gguf", 2)
    for name, config in servers.SERVERS.items():
        assert config.server(name, setup).fallback == (servers.LLAMA_SERVER_FALLBACK if config.baseline else ())


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    server = Server("sleeper", (sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"))
    proc = ServerProcess(server, tmp_path / "sleeper.log", startup_timeout=1)
    with pytest.raises(ServerError, match=r"sleeper was not ready after 1 s(.|\n)*loading"):
        proc.__enter__()
    assert proc.process.returncode is not None  # terminated, not left behind


def test_a_server_is_stopped_when_the_block_raises(fake, tmp_path):
    proc = ServerProcess(Server("fake", fake_argv(fake, "a")), tmp_path / "fake.log")
    with pytest.raises(KeyboardInterrupt):
        with proc:
            assert proc.get_json("/v1/models")["data"][0]["id"] == "fake-a"
            raise KeyboardInterrupt
    assert proc.process.returncode is not None


# ---- whole runs against stand-ins


def test_run_against_stand_ins_records_every_request_and_saves_the_results(fake, tmp_path):
    under_test = [Server("llama-a", fake_argv(fake, "llama-a"), baseline=True),
                  Server("specdec", fake_argv(fake, "same", "plan-1"), token_ids=True),
                  Server(REFERENCE, fake_argv(fake, "same-ref"), token_ids=True)]
    prompts, warmup = servers.load_prompts(("chat", "maths"))
    results = {"servers": {}, "records": []}
    servers.run_servers(under_test, prompts, warmup, max_tokens=5, rounds=2, out=tmp_path, results=results,
                        startup_timeout=60, progress=False)
    records = results["records"]
    assert len(records) == 3 * 4 * 2 and not any("error" in r for r in records)
    assert {(r["server"], r["round"], r["prompt_id"]) for r in records} == {
        (s.name, round_, p["id"]) for s in under_test for round_ in range(2) for p in prompts}
    assert all(r["completion_tokens"] == 5 and r["wall_s"] >= r["first_token_s"] > 0 for r in records)
    assert all(r["decode_tokens_per_s"] > 0 for r in records)
    assert all((r["token_ids"] is not None) == (r["server"] != "llama-a") for r in records)
    assert results["servers"]["specdec"]["kernel_plan"] == {"plan": "plan-1"}
    assert results["servers"]["llama-a"]["kernel_plan"] is None and results["servers"][REFERENCE]["kernel_plan"] is None
    assert results["servers"]["llama-a"]["model"] == "fake-llama-a"
    assert json.loads((tmp_path / "results.json").read_text())["records"] == records
    s = servers.summarise(results)
    assert s["same_text"]["specdec"] == {"same": 8, "compared": 8}
    assert s["same_text"]["llama-a"] == {"same": 0, "compared": 8}
    assert s["same_tokens"] == {"specdec": {"same": 8, "compared": 8}}


def test_concurrent_clients_send_every_prompt_to_each_server_at_once_and_the_all_column_is_throughput(fake, tmp_path):
    under_test = [Server("llama-a", fake_argv(fake, "llama-a"), baseline=True),
                  Server("specdec", fake_argv(fake, "same"), token_ids=True),
                  Server(REFERENCE, fake_argv(fake, "same-ref"), token_ids=True)]
    prompts, warmup = servers.load_prompts(("chat", "maths", "translation"))
    results = {"servers": {}, "records": [], "settings": {"concurrent": 3}}
    servers.run_servers(under_test, prompts, warmup, max_tokens=5, rounds=2, out=tmp_path, results=results,
                        startup_timeout=60, progress=False, concurrent=3)
    records, bursts = results["records"], results["bursts"]
    assert len(records) == 3 * 6 * 2 and not any("error" in r for r in records)
    assert [(b["server"], b["round"]) for b in bursts] == [("llama-a", 0), ("specdec", 0), (REFERENCE, 0),
                                                           ("specdec", 1), (REFERENCE, 1), ("llama-a", 1)]
    assert all(b["completion_tokens"] == 6 * 5 for b in bursts)
    # a burst lasts as long as its slowest client's requests, no longer than all of its requests one after another
    for b in bursts:
        mine = [r for r in records if (r["server"], r["round"]) == (b["server"], b["round"])]
        assert max(r["wall_s"] for r in mine) <= b["wall_s"] <= sum(r["wall_s"] for r in mine) + 1.0
    s = servers.summarise(results)
    for name in ("llama-a", "specdec"):
        seconds = sum(b["wall_s"] for b in bursts if b["server"] == name)
        assert s["tokens_per_s"][name]["all"] == pytest.approx(60 / seconds)
        assert s["counts"][name]["wall_s"] == pytest.approx(seconds)
    assert s["tokens_per_s"]["specdec"]["chat"] == pytest.approx(servers._rate(
        [r for r in records if (r["server"], r["kind"]) == ("specdec", "chat")]))  # a kind's column: per request


def test_concurrent_servers_run_as_many_slots():
    setup = servers.Setup(Path("/bin/llama-server"), "target.gguf", "draft.gguf", 2, concurrent=8)
    llama = servers.SERVERS["llama-server"].argv(setup)
    assert llama[llama.index("-np") + 1] == "8" and llama[llama.index("-c") + 1] == str(8 * servers.CONTEXT)
    ours = servers.SERVERS["specdec"].argv(setup)
    assert ours[ours.index("--max-batch") + 1] == "8"
    alone = servers.Setup(Path("/bin/llama-server"), "target.gguf", "draft.gguf", 2)
    assert "--max-batch" not in servers.SERVERS["specdec"].argv(alone)  # one at a time: the server's defaults
    assert servers.SERVERS["llama-server"].argv(alone)[servers.SERVERS["llama-server"].argv(alone).index("-np") + 1] == "1"


def test_the_command_writes_results_and_report_and_refuses_unknown_names(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "SERVERS", {
        "llama-a": Config(True, lambda s: fake_argv(fake, "llama-a")),
        "specdec": Config(False, lambda s: fake_argv(fake, "same")),
        REFERENCE: Config(False, lambda s: fake_argv(fake, "same-ref")),
    })
    out = tmp_path / "out"
    argv = ["servers", "--kinds", "chat", "--max-tokens", "4", "--threads", "1", "--out", str(out),
            "--llama-server", sys.executable]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == 3 * 2 and results["settings"]["kinds"] == ["chat"]
    assert results["versions"]["llama-cpp-python"] == llama_server.llama_cpp_version()
    assert re.fullmatch(r"[0-9a-f]{8}", results["patch_md5"])
    assert "**specdec and specdec-target-only: 2/2 answers with identical token ids.**" in (out / "report.md").read_text()
    assert (out / "logs" / "llama-a.log").is_file()
    assert main([*argv, "--servers", "specdec,llama-nope"]) == 2
    assert main([*argv, "--kinds", "poetry"]) == 2


def test_a_missing_llama_server_binary_says_to_run_make(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "llama-server"
    assert main(["servers", "--servers", "llama-server", "--llama-server", str(missing),
                     "--out", str(tmp_path / "out")]) == 2
    assert "make llama-server" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_default_binary_path_is_where_the_makefile_builds_it():
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        pytest.skip("llama-cpp-python is not installed")
    root = Path(llama_server.__file__).resolve().parents[1]
    shown = subprocess.run(["make", "-n", "-C", str(root), "llama-server", "LLAMA_CPP_VERSION=" + version],
                           capture_output=True, text=True, check=True).stdout
    assert f"[ ! -x {llama_server.default_llama_server()} ]" in shown


def test_generate_compares_with_llama_server_through_the_same_client(fake, tmp_path, monkeypatch):
    """`specdec-exact generate --compare` times upstream llama-server on the prompt (a warm-up first), through a
    streamed chat request as the benchmarks send; here against the stand-in."""
    def rate(log: str) -> tuple[float, str]:
        with llama_server.llama_server_session(Path("unused"), "model.gguf", 2, "one two three four five", 4,
                                               chat=True, log=tmp_path / log) as (measure, settings):
            return measure(), settings

    monkeypatch.setattr(llama_server, "llama_server_argv", lambda *args, **slots: fake_argv(fake, "llama-x"))
    tokens_per_s, settings = rate("log")
    assert tokens_per_s > 0 and settings == "its defaults"
    # where its defaults crash, the comparison runs with the fallback and says so
    wrapper = tmp_path / "crashes.py"
    wrapper.write_text(CRASHES_WITHOUT_FALLBACK)
    monkeypatch.setattr(llama_server, "llama_server_argv",
                        lambda *args, **slots: (sys.executable, str(wrapper), *fake_argv(fake, "llama-x")[1:]))
    tokens_per_s, settings = rate("log2")
    assert tokens_per_s > 0 and settings == "its defaults and --no-repack: its defaults crash on this CPU"


# ---- python -m benchmarks conversation

def test_bench_conversation_runs_every_turn_on_every_server_and_reports_its_ratios(fake, tmp_path):
    from benchmarks import conversation
    from specdec_exact.bench.runner import machine_info

    fakes = [Server(name, fake_argv(fake, name), token_ids=name != conversation.LLAMA)
             for name in (conversation.CACHED, conversation.COLD, conversation.LLAMA)]
    chats = [{"workload": "chat", "source": f"article {i}", "system": "Be careful.",
              "turns": [f"Article {i} says many things about caches.", *conversation.QUESTIONS[1:]]} for i in range(2)]
    agent = conversation.agent_tasks(1)
    talks = chats + agent
    results = {"command": "python -m benchmarks conversation", "machine": machine_info(), "settings": {"max_tokens": 8},
               "conversations": [t["source"] for t in talks], "servers": {}, "records": []}
    conversation.run(fakes, talks, {"prompt": "warm up"}, 8, tmp_path, results, startup_timeout=30)
    turns, steps = len(conversation.QUESTIONS), len(agent[0]["turns"])
    assert len(results["records"]) == 3 * (2 * turns + steps)
    first = [r for r in results["records"] if r["server"] == conversation.CACHED and r["round"] == 0]
    assert [r["turn"] for r in first] == list(range(1, turns + 1))
    # each turn's message is the last one: the fake answers with its first words
    assert first[1]["text"].split()[1:3] == conversation.QUESTIONS[1].split()[:2]
    loop = [r for r in results["records"] if r["server"] == conversation.LLAMA and r["workload"] == "agent"]
    assert [r["text"].split()[1:3] for r in loop[:3]] == [["Task:", "add"], ["$", "python"], ["$", "grep"]]
    summary = conversation.summarise(results)
    assert set(summary) == {"chat", "agent"} and summary["agent"]["turns"] == steps
    assert summary["chat"]["identical_to_no_cache"] == [2 * turns, 2 * turns]
    assert summary["chat"]["last_turn_first_token_vs_no_cache"] > 0
    assert summary["agent"]["conversation_vs_llama_server"] > 0
    text = conversation.report(results)
    assert "Turn 5, time to first token" in text and f"**{2 * turns}/{2 * turns}**" in text
    assert f"Turn {steps}, time to first token" in text and "## Agent" in text
    assert json.loads((tmp_path / "results.json").read_text())["records"]
    first[2]["token_ids"] = [99]  # one answer that differs is counted
    assert conversation.summarise(results)["chat"]["identical_to_no_cache"] == [2 * turns - 1, 2 * turns]


def test_the_agent_loop_pastes_real_tool_output_of_a_module_and_says_when_there_are_too_few(tmp_path):
    from benchmarks import conversation

    (task,) = conversation.agent_tasks(1)
    name = task["source"].split()[1].removesuffix(".py")
    assert f"$ cat {name}.py\n" in task["turns"][0] and "def " in task["turns"][0]
    assert f"$ python -m pydoc {name}" in task["turns"][1] and f"NAME\n    {name}" in task["turns"][1]
    grep = task["turns"][2].split("\n")[1:-1]
    assert grep and all(re.match(rf"\./\S+\.py:\d+:.*\b{name}\.", line) for line in grep)
    (tmp_path / "fnmatch.py").write_text("def f():\n    pass\n" * 80)
    (tmp_path / "uses.py").write_text("import fnmatch\nfnmatch.f()\n")
    (only,) = conversation.agent_tasks(1, stdlib=tmp_path)
    assert "./uses.py:2:fnmatch.f()" in only["turns"][2]
    assert task["turns"][3].startswith((f"$ sed -n 1,{conversation.TEST_LINES}p test/test_{name}.py\n",
                                        f"$ ls test/test_{name}.py\n"))  # (a standard library without its tests)
    assert "ls: cannot access 'test/test_fnmatch.py'" in only["turns"][3] and len(only["turns"]) == 5
    with pytest.raises(ValueError, match="holds 1 of the agent's modules"):
        conversation.agent_tasks(2, stdlib=tmp_path)


def test_gaps_are_the_longest_wait_between_pieces_that_overlaps_the_window():
    from benchmarks.interleave import gaps

    arrivals = [0.0, 0.1, 0.2, 1.7, 1.8, 4.0]
    assert gaps(arrivals) == pytest.approx(2.2)
    assert gaps(arrivals, 0.15, 1.75) == pytest.approx(1.5)  # the 2.2 s wait began after the window closed
    assert gaps(arrivals, 1.75, 5.0) == pytest.approx(2.2) and gaps(arrivals, 0.0, 0.05) == pytest.approx(0.1)
    assert gaps([1.0]) is None


def test_bench_interleave_sends_the_long_prompt_while_the_answer_streams_and_reports_the_gaps(fake, tmp_path):
    from benchmarks import interleave
    from specdec_exact.bench.runner import machine_info

    fakes = [Server(interleave.SPECDEC, fake_argv(fake, "specdec"), token_ids=True),
             Server(interleave.LLAMA, fake_argv(fake, "llama"), baseline=True)]
    long_prompt = {"source": "article", "text": "A long article " * 50}
    results = {"command": "python -m benchmarks interleave", "machine": machine_info(),
               "settings": {"max_tokens": 16, "long_max_tokens": 4}, "servers": {}, "records": []}
    interleave.run(fakes, [long_prompt], {"prompt": "warm up"}, 16, 4, tmp_path, results, startup_timeout=30)
    records = {r["server"]: r for r in results["records"]}
    assert set(records) == {interleave.SPECDEC, interleave.LLAMA}
    ours = records[interleave.SPECDEC]
    assert ours["streamed_tokens"] == 16 and ours["long_completion_tokens"] == 4
    assert ours["streamed_identical_to_alone"] is True
    assert records[interleave.LLAMA]["streamed_identical_to_alone"] is None  # (no token ids)
    # the long prompt went out after STARTED_AFTER pieces of the streamed answer had come
    assert sum(t <= 0 for t in ours["arrivals_from_long_sent_s"]) >= interleave.STARTED_AFTER
    assert ours["longest_gap_s"] >= 0  # (the fake has answered all before the long prompt is read: no gap then)
    summary = interleave.summarise(results)
    assert summary["servers"][interleave.SPECDEC]["identical_to_alone"] == [1, 1]
    text = interleave.report(results)
    assert "| specdec | 1 |" in text and "1/1" in text
    assert json.loads((tmp_path / "results.json").read_text())["records"]


def test_bench_interleave_takes_articles_of_about_two_thousand_tokens():
    from benchmarks import interleave

    prompts = interleave.long_prompts(2)
    assert len(prompts) == 2 and prompts[0]["source"] != prompts[1]["source"]
    assert all(interleave.ARTICLE_CHARS[0] < len(p["text"]) and p["text"].endswith("three sentences.")
               for p in prompts)
    with pytest.raises(ValueError, match="fewer than the 1000 rounds"):
        interleave.long_prompts(1000)


def test_the_api_features_benchmark_pools_each_servers_rate_per_feature_and_compares_them():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "api_features.py"
    spec = importlib.util.spec_from_file_location("api_features", path)
    features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(features)

    def rec(server, feature, tokens, seconds, **extra):
        return {"server": server, "feature": feature, "completion_tokens": tokens, "wall_s": seconds, **extra}

    records = [rec("llama-server", f, 100, 5, first_token_s=1.0) for f in features.FEATURES]
    records += [rec("specdec", "none", 100, 4, first_token_s=1.0), rec("specdec", "none", 50, 1, first_token_s=0.5),
                rec("specdec", "logprobs", 100, 5, first_token_s=0.6),
                rec("specdec", "json_schema", 120, 4, first_token_s=0.5),
                rec("specdec", "json_schema", 0, 0.0, error="APIError: x")]
    results = {"records": records, "command": "python benchmarks/api_features.py", "versions": {},
               "machine": {"cpu": "cpu", "cores": 2}, "settings": {"max_tokens": 128, "rounds": 1}}
    rate = features.rates(results)
    assert rate["specdec"] == {"none": 30.0, "logprobs": 20.0, "json_schema": 30.0}  # pooled: 150 tokens / 5 s
    assert features.rates(results, decode=True)["specdec"]["none"] == pytest.approx(148 / 3.5)  # after the first
    text = features.report(results)
    assert "| specdec | 30.00 | 20.00 | 30.00 | 0.67x | 1.00x |" in text
    assert "none 1.50x, logprobs 1.00x, json_schema 1.50x" in text and "failed: 1" in text
