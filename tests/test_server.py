"""The OpenAI-compatible server: real uvicorn on a loopback port, the official openai client, tiny models."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec import SpeculativeGenerator, server
from specdec.server import create_app

from conftest import char_tokenizer, close_draft, tiny_model

MODEL = "tiny-qwen2"
KEY = "sekrit"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def generator():
    target = tiny_model("qwen2", seed=0, vocab_size=60)
    draft = close_draft(target)
    tokenizer = char_tokenizer()  # a fresh instance: the chat template is set on this copy only
    tokenizer.chat_template = CHAT_TEMPLATE
    return SpeculativeGenerator(target, draft, k=3, tokenizer=tokenizer, draft_tokenizer=tokenizer)


@contextlib.contextmanager
def serve(app):
    """Run app on uvicorn in a thread, on a free port of 127.0.0.1 -> its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def url(generator):
    with serve(create_app(generator, MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


@contextlib.contextmanager
def forward_hook(model, hook):
    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def pending(url: str) -> int:
    return httpx.get(f"{url}/health").json()["pending"]


# ---- answers


def test_greedy_completion_equals_generate(client, generator):
    for prompt in ["def f(x):", "hello world"]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        ref = generator.generate(prompt, max_new_tokens=30)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        n_prompt = len(generator.encode(prompt))
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
        assert out.usage.total_tokens == n_prompt + len(ref.token_ids)
        stats = out.model_extra["specdec"]
        assert stats["drafted_tokens"] > 0 and stats["new_tokens"] == len(ref.token_ids)
        assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["drafted_tokens"]
        assert stats["mean_accepted_length"] >= 1


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_gives_each_answers_tokens_streamed_or_not(client, generator, chat):
    """The extension vLLM offers too: each choice carries its token ids, so a client can compare answers token for
    token (specdec load does). Only when asked."""
    ref = generator.generate("hello", chat=chat, max_new_tokens=20)
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    whole = create(model=MODEL, max_tokens=20, temperature=0, extra_body={"return_token_ids": True}, **prompt)
    assert whole.choices[0].model_extra["token_ids"] == ref.token_ids
    streamed = [c for c in create(model=MODEL, max_tokens=20, temperature=0, stream=True,
                                  extra_body={"return_token_ids": True}, **prompt) if c.choices]
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == ref.token_ids
    plain = create(model=MODEL, max_tokens=20, temperature=0, **prompt)
    assert "token_ids" not in plain.choices[0].model_extra


def test_prompt_as_token_ids(client, generator):
    ids = generator.encode("abc")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert out.choices[0].text == generator.generate("abc", max_new_tokens=12).text


def test_greedy_chat_equals_generate_with_chat(client, generator):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=25, temperature=0)
    ref = generator.generate("hello", chat=True, max_new_tokens=25)  # what `specdec generate --chat` prints
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(generator.encode("hello", chat=True))
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.model_extra["specdec"]["drafted_tokens"] > 0


def test_chat_applies_the_template_to_every_message(client, generator):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # content as parts, as OpenAI allows
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=15, temperature=0)
    text = "system: be brief\nuser: hi\nassistant:"
    ids = generator.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.choices[0].message.content == generator.generate(ids, max_new_tokens=15).text


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream_for_the_same_seed(client, chat):
    settings = dict(model=MODEL, max_tokens=40, temperature=0.9, top_p=0.95, seed=7)
    if chat:
        create, settings["messages"] = client.chat.completions.create, [{"role": "user", "content": "tell me"}]
    else:
        create, settings["prompt"] = client.completions.create, "once upon"
    whole = create(**settings)
    chunks = list(create(**settings, stream=True))
    pieces = [c.choices[0].delta.content if chat else c.choices[0].text for c in chunks]
    text = whole.choices[0].message.content if chat else whole.choices[0].text
    assert "".join(pieces) == text and len(chunks) > 1
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    counts = ["cycles", "drafted_tokens", "accepted_tokens", "new_tokens", "emitted_per_cycle"]
    streamed_stats, whole_stats = chunks[-1].model_extra["specdec"], whole.model_extra["specdec"]
    assert [streamed_stats[c] for c in counts] == [whole_stats[c] for c in counts]
    assert len({c.id for c in chunks}) == 1

    with_usage = list(create(**settings, stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.model_dump() == whole.usage.model_dump()
    assert with_usage[-1].model_extra["specdec"]["new_tokens"] == whole.usage.completion_tokens
    assert "specdec" not in (with_usage[-2].model_extra or {})


def test_stream_ends_with_done(url):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1])


def test_stop_strings(client, generator):
    full = generator.generate("hello", max_new_tokens=40).text
    assert len(full) > 10
    for stop in [full[5:7], [full[8:10], "zzzz"]]:
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0, stop=stop)
        ref = generator.generate("hello", max_new_tokens=40, stop=[stop] if isinstance(stop, str) else stop)
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == len(ref.token_ids)
        streamed = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0, stop=stop,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": MODEL, "pending": 0, "batch": 0,
                                                       "cross_vocabulary": None}


# ---- bad input: a 4xx in OpenAI's error shape, never a 500 or a hang

LONG = "a" * 300  # more characters (= tokens) than the tiny target's 256 positions

BAD_REQUESTS = [
    ("malformed json", "/v1/completions", '{"model": "tiny-qwen2", "prompt": "ab"', 400, None),
    ("body not an object", "/v1/completions", "[1, 2]", 400, None),
    ("empty body", "/v1/chat/completions", "", 400, None),
    ("missing model", "/v1/completions", {"prompt": "ab"}, 400, "model"),
    ("prompt wrong type", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": "10"}, 400,
     "max_tokens"),
    ("temperature wrong type", "/v1/completions", {"model": MODEL, "prompt": "ab", "temperature": "hot"}, 400,
     "temperature"),
    ("stream wrong type", "/v1/completions", {"model": MODEL, "prompt": "ab", "stream": "yes"}, 400, "stream"),
    ("messages wrong type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x", "content": "a"}]}, 400,
     "messages"),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 10**9}, 400, "max_tokens"),
    ("huge max_tokens chat", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 300}, 400, "max_tokens"),
    ("prompt longer than the context", "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 1}, 400,
     "prompt"),
    ("prompt fills the context", "/v1/completions", {"model": MODEL, "prompt": "a" * 256, "max_tokens": 0}, 400,
     "prompt"),  # no room for even one token: the one context check refuses it
    ("messages longer than the context", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("streamed prompt fills the context", "/v1/completions",
     {"model": MODEL, "prompt": "a" * 256, "max_tokens": 0, "stream": True}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "ab"}, 404, "model"),
    ("unknown model chat", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "ab", "temperature": -0.5}, 400,
     "temperature"),
    ("temperature not a number", "/v1/completions", '{"model": "tiny-qwen2", "prompt": "ab", "temperature": NaN}',
     400, "temperature"),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "ab", "top_p": 0}, 400, "top_p"),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "ab", "n": 2}, 400, "n"),
    ("n > 1 chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "n": 3},
     400, "n"),
    ("unsupported logprobs", "/v1/completions", {"model": MODEL, "prompt": "ab", "logprobs": 2}, 400, "logprobs"),
    ("too many stop strings", "/v1/completions", {"model": MODEL, "prompt": "ab", "stop": list("abcde")}, 400,
     "stop"),
    ("seed out of range", "/v1/completions", {"model": MODEL, "prompt": "ab", "seed": 2**70}, 400, "seed"),
    ("temperature above OpenAI's 2", "/v1/completions", {"model": MODEL, "prompt": "ab", "temperature": 2.5}, 400,
     "temperature"),
    ("lone surrogate in the prompt", "/v1/completions", '{"model": "tiny-qwen2", "prompt": "a\\ud800b"}', 400,
     "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_in_openai_shape(url, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    if param == "n":
        assert "n must be 1" in error["message"]
    assert pending(url) == 0


def test_a_huge_body_is_refused_before_it_is_read_and_the_server_keeps_answering(url):
    from specdec.server import MAX_BODY_BYTES

    huge = json.dumps({"model": MODEL, "prompt": "a" * (MAX_BODY_BYTES + 1)})
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", content=huge, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - started < 5
    chunked = httpx.post(f"{url}/v1/completions", content=iter([huge.encode()[i:i + 2**20]
                                                                for i in range(0, len(huge), 2**20)]),
                         headers={"Content-Type": "application/json"}, timeout=30)  # no Content-Length
    assert chunked.status_code == 413
    assert httpx.get(f"{url}/health").json()["status"] == "ok" and pending(url) == 0


def test_unknown_route_and_method_in_openai_shape(url):
    for response, status in [(httpx.get(f"{url}/v1/nope"), 404), (httpx.get(f"{url}/v1/completions"), 405)]:
        assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param",
                                                                                    "code"}


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=MODEL, prompt="ab", n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "a"}])


# ---- concurrency


def test_concurrent_requests_each_match_their_sequential_answer(client, generator):
    jobs = [dict(prompt=f"job {i}:", max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(20)]
    expected = [generator.generate(j["prompt"], max_new_tokens=16, temperature=j["temperature"], seed=j["seed"]).text
                for j in jobs]
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda j: client.completions.create(model=MODEL, **j).choices[0].text, jobs))
    assert answers == expected


def test_full_queue_gets_503_then_recovers(generator):
    expected = generator.generate("ab", max_new_tokens=4).text  # now: the server's requests will hold the model
    gate = threading.Event()

    def blocked(*args):  # returns None: the forward pass's output is kept
        gate.wait(20)

    with serve(create_app(generator, MODEL, max_queue=1, max_batch=1)) as base, forward_hook(generator.target, blocked), \
            ThreadPoolExecutor(2) as pool:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        ask = lambda: client.completions.create(model=MODEL, prompt="ab", max_tokens=4, temperature=0).choices[0].text
        holder = pool.submit(ask)
        wait_for(lambda: pending(base) == 1)  # generating, blocked in the target's forward pass
        waiter = pool.submit(ask)
        wait_for(lambda: pending(base) == 2)  # one waiting: the queue is full
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "ab"}, timeout=5)
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
        gate.set()
        assert holder.result(20) == waiter.result(20) == expected
        assert pending(base) == 0
        assert metric(base, "specdec_requests_total", endpoint="/v1/completions", status="503") == 1


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnecting_mid_generation_frees_the_model(url, client, generator, stream):
    prompt, budget = "a", 60
    full = generator.generate(prompt, max_new_tokens=budget)
    assert full.stats.target_calls > 15  # the whole generation takes many slowed-down cycles
    calls = []

    def slow(*args):
        calls.append(1)
        time.sleep(0.05)

    tokens_before = metric(scrape(url), "specdec_completion_tokens_total")
    with forward_hook(generator.target, slow):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": budget, "temperature": 0, "stream": stream}
        if stream:  # read the first event, then hang up
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as response:
                assert next(response.iter_lines()).startswith("data: {")
        else:  # give up waiting for the whole answer
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
        # The connection is closed: the server stops at the next cycle and frees the model.
        wait_for(lambda: pending(url) == 0, timeout=5)
        if stream:  # the tokens it generated before the client left are counted
            wait_for(lambda: metric(scrape(url), "specdec_completion_tokens_total") > tokens_before, timeout=5)
        assert len(calls) < full.stats.target_calls / 2
        started = time.monotonic()
        out = client.completions.create(model=MODEL, prompt="xy", max_tokens=3, temperature=0)
        assert time.monotonic() - started < 5
    assert out.choices[0].text == generator.generate("xy", max_new_tokens=3).text


# ---- metrics and access


def scrape(base: str) -> list:
    text = httpx.get(f"{base}/metrics").text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric(samples_or_base, name: str, **labels) -> float:
    samples = scrape(samples_or_base) if isinstance(samples_or_base, str) else samples_or_base
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_move(url, client):
    names = ["specdec_prompt_tokens_total", "specdec_completion_tokens_total", "specdec_drafted_tokens_total",
             "specdec_accepted_tokens_total"]
    chat = dict(endpoint="/v1/chat/completions")
    before = scrape(url)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=20,
                                         temperature=0)
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ""}).status_code == 400
    after = scrape(url)
    stats = out.model_extra["specdec"]
    moved = [out.usage.prompt_tokens, out.usage.completion_tokens, stats["drafted_tokens"], stats["accepted_tokens"]]
    assert [metric(after, n) - metric(before, n) for n in names] == moved
    for name, labels in [("specdec_requests_total", dict(status="200", **chat)),
                         ("specdec_requests_total", dict(status="400", endpoint="/v1/completions")),
                         ("specdec_time_to_first_token_seconds_count", chat),
                         ("specdec_request_latency_seconds_count", chat)]:
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1, name
    assert 0 < metric(after, "specdec_acceptance_rate") <= 1
    assert metric(after, "specdec_verify_cycles_total") > metric(before, "specdec_verify_cycles_total")
    assert metric(after, "specdec_queue_depth") == 0 and metric(after, "specdec_batch_occupancy") == 0
    assert (metric(after, "specdec_request_acceptance_rate_count")
            == metric(before, "specdec_request_acceptance_rate_count") + (stats["drafted_tokens"] > 0))


def test_api_key_is_enforced_except_on_health(generator):
    with serve(create_app(generator, MODEL, api_key=KEY)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        for path in ["/v1/models", "/metrics"]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}]:
                response = httpx.get(f"{base}{path}", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        response = httpx.post(f"{base}/v1/completions", content="{not json")
        assert response.status_code == 401  # refused before the body is even read
        assert httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
        out = keyed.completions.create(model=MODEL, prompt="ab", max_tokens=5, temperature=0)
        assert out.choices[0].text == generator.generate("ab", max_new_tokens=5).text


# ---- `specdec serve`


def test_serve_command_builds_one_generator_and_binds_loopback(monkeypatch, generator):
    import specdec.generator

    built, ran = [], {}
    monkeypatch.setattr(specdec.generator, "SpeculativeGenerator", lambda *args, **kw: built.append(args) or generator)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(app=app, **kw))
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    server.add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--target", "some/model", "--draft", "none", "--max-queue", "3"])
    assert args.func(args) == 0
    assert built == [("some/model", None)]
    assert (ran["host"], ran["port"]) == ("127.0.0.1", 8000)
    service = ran["app"].state.service
    assert (service.model_name, service.scheduler.max_queue) == ("some/model", 3)


# ---- the load generator (specdec load)


def test_load_generator_drives_both_servers_and_checks_every_answer(generator, tmp_path):
    from specdec.bench import load

    results = load.run_load(generator, ["ab", "def f(x):", "hello", "xyz xyz"], clients=[1, 2], requests=2,
                            max_tokens=8, max_batch=4)
    rows = results["rows"]
    assert [(r["server"], r["clients"]) for r in rows] == [("one at a time", 1), ("batched (max 4)", 1),
                                                           ("one at a time", 2), ("batched (max 4)", 2)]
    assert all(r["identical"] == r["requests"] == 2 * r["clients"] and r["tokens"] > 0 and not r["different"]
               for r in rows)
    assert all(r["failed"] == 0 and not r["errors"] and r["peak_rss_mb"] >= results["rss_before_mb"] * 0.5
               for r in rows)
    text = load.report(results)
    assert "| 2 | 1 | batched (max 4) | 4/4 |" in text and "token for token: 12/12" in text
    load.plot(results, tmp_path / "throughput.png")
    assert (tmp_path / "throughput.png").stat().st_size > 0
    with pytest.raises(ValueError, match="--clients"):
        load._counts("1,x")


def test_load_prompts_come_from_the_chosen_tasks_in_turn_and_unknown_tasks_are_refused(generator):
    import argparse

    from specdec.bench import load

    prompts = load.load_prompts(generator, 5, ("maths", "code"), max_tokens=2000)
    assert len(prompts) == 5 and prompts[0].startswith("Solve this maths") and prompts[1].startswith("Complete")
    assert prompts[2].startswith("Solve this maths") and prompts[2] != prompts[0]
    with pytest.raises(ValueError, match="no prompt of maths has at most 2 tokens"):
        load.load_prompts(generator, 2, ("maths",), max_tokens=2)
    args = argparse.Namespace(clients="1", requests=1, max_tokens=8, max_batch=4, tasks="maths,poetry", rounds=1,
                              max_prompt_tokens=160, stagger=0.0, only_batched=False)
    with pytest.raises(ValueError, match="--tasks takes some of code, summarisation, maths"):
        load.run_load_command(args)


def test_load_generator_counts_failed_requests_and_goes_on(generator):
    """A request the server refuses (503: no room in its queue) is counted as failed with its reason; the other
    clients' answers are still checked."""
    from specdec.bench import load

    prompts = ["ab", "cd", "ef"]
    references = {p: generator.generate(p, max_new_tokens=16, chat=True).token_ids for p in prompts}
    with forward_hook(generator.target, lambda *args: time.sleep(0.02)), \
            serve(create_app(generator, load.MODEL_NAME, max_queue=0, max_batch=1)) as base:
        row = load._drive(base, prompts, references, clients=3, max_tokens=16)
    assert row["failed"] >= 1 and row["identical"] == row["requests"] - row["failed"] >= 1, row["errors"]
    assert any("503" in error or "busy" in error.lower() for error in row["errors"]), row["errors"]


def test_a_draft_with_another_tokenizer_serves_the_targets_output():
    """Cross-vocabulary drafting behind the server: /health says how it drafts, and concurrent completions (batched,
    each with its own forked drafter) equal the generator's own output, greedy and seeded."""
    from test_cross_vocab import ALPHABET, DRAFT_MERGES, TARGET_MERGES

    from conftest import byte_bpe_tokenizer

    target_tokenizer = byte_bpe_tokenizer(ALPHABET, TARGET_MERGES)
    draft_tokenizer = byte_bpe_tokenizer(ALPHABET[::-1], DRAFT_MERGES)
    gen = SpeculativeGenerator(tiny_model("qwen2", seed=0, vocab_size=len(target_tokenizer)),
                               tiny_model("llama", seed=4, vocab_size=len(draft_tokenizer)), k=2,
                               tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    prompts = ["abcd", "hgfe ab", "cafe", "dead beef", "é a b"]
    with serve(create_app(gen, MODEL)) as base:
        assert "shared-vocabulary rejection sampling" in httpx.get(f"{base}/health").json()["cross_vocabulary"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        for temperature in (0.0, 0.8):
            def complete(prompt):
                return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=temperature,
                                                 seed=3).choices[0].text
            with ThreadPoolExecutor(len(prompts)) as pool:
                texts = list(pool.map(complete, prompts))
            for prompt, text in zip(prompts, texts):
                assert text == gen.generate(prompt, max_new_tokens=12, temperature=temperature, seed=3).text, prompt
