"""The OpenAI-compatible server: real uvicorn on a loopback port, the official openai client, tiny models."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec_exact import SpeculativeGenerator, server
from specdec_exact.adjust import LogitAdjust
from specdec_exact.logprobs import token_logprobs
from specdec_exact.runtimes import runtime_of
from specdec_exact.server import create_app

from conftest import char_tokenizer, close_draft, serve, tiny_model

MODEL = "tiny-qwen2"
STATS = {"return_speculation_stats": True}  # the answer carries its speculation stats (`specdec`): only when asked
KEY = "sekrit"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def generator():
    target = tiny_model("qwen2", seed=0, vocab_size=60)
    draft = close_draft(target)
    tokenizer = char_tokenizer()  # a fresh instance: the chat template is set on this copy only
    tokenizer.chat_template = CHAT_TEMPLATE
    return SpeculativeGenerator(target, draft, k=3, tokenizer=tokenizer, draft_tokenizer=tokenizer)


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


def fail_once(monkeypatch, owner, name: str, error: BaseException, when) -> None:
    """owner.name raises `error` the first time it is called on an object for which when(object) holds, and works
    as before otherwise."""
    real, raised = getattr(owner, name), []

    def once(obj, *args, **kwargs):
        if not raised and when(obj):
            raised.append(1)
            raise error
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(owner, name, once)


# ---- answers


def test_greedy_completion_equals_generate(client, generator):
    for prompt in ["def f(x):", "hello world"]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body=STATS)
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


def one_token_logprobs(generator, prompt_ids: list[int], tokens: list[int], top: int):
    """The tokens' log-probabilities as plain decoding gives them: the prompt's pass, then one token a pass."""
    runner = runtime_of(generator.target).pool(generator.target).take(generator.vocab_size)
    try:
        rows = [runner.forward(torch.tensor([prompt_ids]), last_only=True)[0, -1]]
        rows += [runner.forward(torch.tensor([[token]]))[0, -1] for token in tokens[:-1]]
    finally:
        runner.close()
    return list(token_logprobs(torch.stack(rows), tokens, top))


def test_logprobs_are_those_of_one_token_decoding_greedy_and_sampled(generator, monkeypatch):
    """Every committed token's log-probability (and its position's top 3) equals, bit for bit, what plain one-token
    decoding of the target gives there, for tokens committed by multi-token verify passes. Negative control:
    verify passes one float step off (as a kernel that rounds by pass width would be) are caught."""
    prompt = "abcabcab"
    ids = generator.encode(prompt)
    runner_class = type(runtime_of(generator.target).pool(generator.target).take(generator.vocab_size))
    outs = {}
    for temperature, seed in ((0.0, None), (0.9, 3)):
        out = generator.generate(prompt, max_new_tokens=24, temperature=temperature, seed=seed, logprobs=3)
        assert out.stats.accepted_tokens > 0 and len(out.logprobs) == len(out.token_ids) > 3
        assert [lp.token for lp in out.logprobs] == out.token_ids
        assert out.logprobs == one_token_logprobs(generator, ids, out.token_ids, 3)
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob for lp in out.logprobs)
        outs[temperature] = out
    exact_forward = runner_class.forward

    def off_when_wide(runner, input_ids, last_only=False):
        logits = exact_forward(runner, input_ids, last_only)
        verifying = input_ids.shape[1] > 1 and runner.length > input_ids.shape[1]  # (not a prompt)
        return torch.nextafter(logits, torch.tensor(float("inf"))) if verifying else logits

    monkeypatch.setattr(runner_class, "forward", off_when_wide)
    off = generator.generate(prompt, max_new_tokens=24, logprobs=3)
    monkeypatch.undo()
    assert off.logprobs != one_token_logprobs(generator, ids, off.token_ids, 3)
    assert generator.generate(prompt, max_new_tokens=24, logprobs=3).logprobs == outs[0.0].logprobs


def one_token_decoding(generator, prompt_ids: list[int], n: int, adjust: LogitAdjust) -> list[int]:
    """Greedy plain decoding with a logit bias and penalties: a pass a token, each row adjusted for what came before."""
    runner = runtime_of(generator.target).pool(generator.target).take(generator.vocab_size)
    try:
        row, out = runner.forward(torch.tensor([prompt_ids]), last_only=True)[0, -1], []
        while len(out) < n:
            token = int(adjust.rows(row[None], out, [])[0].argmax())
            if token in generator.eos_ids:
                break
            out.append(token)
            row = runner.forward(torch.tensor([[token]]))[0, -1]
    finally:
        runner.close()
    return out


def test_logit_bias_and_penalties_apply_at_every_draft_position_as_one_token_decoding_does(generator, monkeypatch):
    """The penalty at a draft position counts the draft tokens before it: greedy output with a bias and presence and
    frequency penalties equals plain decoding's with them, with drafts accepted. Negative control: penalties that
    count only the tokens committed before the pass change the answer."""
    ids = generator.encode("abcab")
    plain = generator.generate("abcab", max_new_tokens=30)
    adjust = LogitAdjust(bias=((plain.token_ids[0], -100.0),), presence=0.6, frequency=1.2)
    expected = one_token_decoding(generator, ids, 30, adjust)
    out = generator.generate("abcab", max_new_tokens=30, adjust=adjust)
    assert out.token_ids == expected and out.stats.accepted_tokens > 5
    assert plain.token_ids[0] not in out.token_ids and out.token_ids != plain.token_ids[:len(out.token_ids)]
    rows = LogitAdjust.rows
    monkeypatch.setattr(LogitAdjust, "rows", lambda self, logits, generated, fed: torch.cat(
        [rows(self, logits[j:j + 1], generated, []) for j in range(logits.shape[0])]))
    assert generator.generate("abcab", max_new_tokens=30, adjust=adjust).token_ids != expected


def test_logit_bias_and_penalties_through_the_official_client_are_generates(client, url, generator):
    plain = generator.generate("abcab", max_new_tokens=20)
    adjust = LogitAdjust(bias=((plain.token_ids[0], -100.0), (plain.token_ids[1], 5.0)), presence=0.5, frequency=1.0)
    expected = generator.generate("abcab", max_new_tokens=20, adjust=adjust).text
    out = client.completions.create(model=MODEL, prompt="abcab", max_tokens=20, temperature=0,
                                    logit_bias={str(token): bias for token, bias in adjust.bias},
                                    presence_penalty=0.5, frequency_penalty=1.0)
    assert out.choices[0].text == expected != plain.text
    for body, says in [({"logit_bias": {"abc": 1}}, "token ids"), ({"logit_bias": {"100000": 1}}, "beyond"),
                       ({"logit_bias": {"3": 101}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"frequency_penalty": "1"}, "frequency_penalty")]:
        reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
        assert reply.status_code == 400 and says in json.dumps(reply.json()), (body, reply.text)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_through_the_official_client_are_generates(client, generator, stream):
    """Completions (logprobs=N: tokens, token_logprobs, top_logprobs, text_offset) and chat (logprobs, top_logprobs:
    content entries with bytes), whole and streamed: the figures generate() reports, unchanged through JSON."""
    ref = generator.generate("abcab", max_new_tokens=12, logprobs=2)
    out = client.completions.create(model=MODEL, prompt="abcab", max_tokens=12, temperature=0, logprobs=2,
                                    stream=stream)
    choices = [chunk.choices[0] for chunk in out] if stream else [out.choices[0]]
    got = [lp for choice in choices if choice.logprobs for lp in choice.logprobs.token_logprobs]
    assert got == [lp.logprob for lp in ref.logprobs]
    tokens = [t for choice in choices if choice.logprobs for t in choice.logprobs.tokens]
    assert "".join(tokens) == ref.text
    offsets = [o for choice in choices if choice.logprobs for o in choice.logprobs.text_offset]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    tops = [top for choice in choices if choice.logprobs for top in choice.logprobs.top_logprobs]
    assert [sorted(top.values(), reverse=True) for top in tops] == [[v for _, v in lp.top] for lp in ref.logprobs]

    chat_ref = generator.generate("hello", chat=True, max_new_tokens=12, logprobs=2)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=stream)
    choices = [chunk.choices[0] for chunk in out] if stream else [out.choices[0]]
    content = [entry for choice in choices if choice.logprobs for entry in choice.logprobs.content]
    assert [entry.logprob for entry in content] == [lp.logprob for lp in chat_ref.logprobs]
    assert [[alt.logprob for alt in entry.top_logprobs] for entry in content] == [
        [v for _, v in lp.top] for lp in chat_ref.logprobs]
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == chat_ref.text


def test_echo_gives_the_prompt_and_its_tokens_logprobs_as_one_token_decoding_does(client, generator):
    """An evaluation harness's request (lm-eval's local-completions: echo, logprobs, max_tokens 0): the prompt's
    text and each of its tokens' log-probabilities (the first has none) equal to one-token passes over it."""
    ids = generator.encode("abcabdabe")
    expected = one_token_logprobs(generator, ids[:1], ids[1:], 1)
    assert generator.prompt_logprobs(ids, 1)[1:] == expected
    out = client.completions.create(model=MODEL, prompt="abcabdabe", max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == "abcabdabe" and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [lp.logprob for lp in expected]
    assert "".join(choice.logprobs.tokens) == "abcabdabe" and choice.logprobs.top_logprobs[0] is None
    more = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True, temperature=0)
    assert more.choices[0].text.startswith("abcabdabe") and more.choices[0].logprobs is None


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_are_the_samples_of_seeds_seed_to_seed_plus_n_minus_1(client, generator, chat):
    """n choices of one prompt: choice i is the sample generate gives with seed + i (as generate_many), with its
    index; usage counts the prompt once and every choice's tokens; greedy choices are all the same."""
    settings = dict(model=MODEL, max_tokens=12, temperature=0.9, seed=40, n=3)
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": "tell me"}], **settings)
        texts = [choice.message.content for choice in out.choices]
    else:
        out = client.completions.create(prompt="once upon", **settings)
        texts = [choice.text for choice in out.choices]
    prompt = "tell me" if chat else "once upon"
    expected = [generator.generate(prompt, chat=chat, max_new_tokens=12, temperature=0.9, seed=40 + i)
                for i in range(3)]
    assert texts == [e.text for e in expected] and [c.index for c in out.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert out.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert out.usage.prompt_tokens == len(generator.encode(prompt, chat=chat))
    greedy = client.completions.create(model=MODEL, prompt="once upon", max_tokens=8, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_logprobs_not_asked_for_are_none_and_bad_settings_are_refused(client, url):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    assert out.choices[0].logprobs is None
    for body, says in [({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "needs logprobs"),
                       ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                        "top_logprobs"),
                       ({"prompt": "hi", "logprobs": -1}, "logprobs"),
                       ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs")]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        reply = httpx.post(f"{url}{path}", json={"model": MODEL, **body})
        assert 400 <= reply.status_code < 500 and says in json.dumps(reply.json()), (body, reply.text)


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_gives_each_answers_tokens_streamed_or_not(client, generator, chat):
    """The extension vLLM offers too: each choice carries its token ids, so a client can compare answers token for
    token (python -m benchmarks load does). Only when asked."""
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
                                         max_tokens=25, temperature=0, extra_body=STATS)
    ref = generator.generate("hello", chat=True, max_new_tokens=25)  # what `specdec-exact generate --chat` prints
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
    settings = dict(model=MODEL, max_tokens=40, temperature=0.9, top_p=0.95, seed=7, extra_body=STATS)
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


@pytest.mark.parametrize("stream", [False, True])
def test_speculation_stats_are_sent_only_when_asked_for(client, stream):
    """How much of an answer was drafted says something of the text other requests left in the drafters' history:
    the stats go only to a request that asks (`return_speculation_stats`), whole or streamed, with usage or not."""
    settings = dict(model=MODEL, prompt="abcabcabc", max_tokens=12, temperature=0)
    for options in ({}, {"stream_options": {"include_usage": True}}):
        replies = {}
        for asked in (False, True):
            extra = {"extra_body": STATS} if asked else {}
            out = client.completions.create(**settings, **extra, **(options if stream else {}), stream=stream)
            replies[asked] = list(out) if stream else [out]
        assert not any("specdec" in (reply.model_extra or {}) for reply in replies[False])
        carrying = [reply for reply in replies[True] if "specdec" in (reply.model_extra or {})]
        assert len(carrying) == 1 and carrying[0] is replies[True][-1]
        usage = replies[True][-1].usage
        assert {"drafted_tokens", "accepted_tokens"} <= set(carrying[0].model_extra["specdec"])
        assert usage is None or carrying[0].model_extra["specdec"]["new_tokens"] == usage.completion_tokens


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
    ("n > 1 streamed", "/v1/completions", {"model": MODEL, "prompt": "ab", "n": 2, "stream": True}, 400, "n"),
    ("n > 1 chat streamed", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                     "n": 3, "stream": True}, 400, "n"),
    ("n beyond 16", "/v1/completions", {"model": MODEL, "prompt": "ab", "n": 17}, 400, "n"),
    ("echo streamed", "/v1/completions", {"model": MODEL, "prompt": "ab", "echo": True, "stream": True}, 400,
     "echo"),
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
    assert pending(url) == 0


def test_a_huge_body_is_refused_before_it_is_read_and_the_server_keeps_answering(url):
    from specdec_exact.server import MAX_BODY_BYTES

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
    with pytest.raises(openai.BadRequestError, match="answered whole"):
        client.completions.create(model=MODEL, prompt="ab", n=2, stream=True)
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
                                         temperature=0, extra_body=STATS)
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
        for path in ["/v1/models", "/metrics", "/docs", "/openapi.json", "/v1/specdec/plan"]:
            assert httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
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


def test_each_keys_requests_draft_only_from_that_keys_earlier_text_unless_shared():
    """With several API keys, the suffix lookup drafts a key's request from that key's earlier requests alone: after
    key A's answer, A's next request with the same prompt drafts it from history and has it accepted, key B's does
    not find it (its acceptance would tell B what A was answered). Negative control: shared across keys, B drafts it
    too. The answers are the target's either way."""
    target = tiny_model("qwen2", seed=0, vocab_size=60)
    prompt, settings = "kqzjxwvu", dict(model=MODEL, max_tokens=24, temperature=0, extra_body=STATS)
    accepted = {}
    for shared in (False, True):
        gen = SpeculativeGenerator(target, "suffix", k=3, tokenizer=char_tokenizer())
        with serve(create_app(gen, MODEL, api_key=["key-a", "key-b"], share_across_keys=shared)) as base:
            a, b = (openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
                    for key in ("key-a", "key-b"))
            first = a.completions.create(prompt=prompt, **settings)
            other, again = b.completions.create(prompt=prompt, **settings), a.completions.create(prompt=prompt,
                                                                                                 **settings)
        assert first.choices[0].text == other.choices[0].text == again.choices[0].text
        accepted[shared] = [reply.model_extra["specdec"]["accepted_tokens"] for reply in (first, other, again)]
    (first, other, again), (_, shared_other, _) = accepted[False], accepted[True]
    assert again > first and again > other, accepted  # A's history holds its answer; B's does not
    assert shared_other == again, accepted


# ---- `specdec-exact serve`


def served_when_loaded(ran: dict, bound: threading.Event | None = None):
    """A stand-in for uvicorn.Server.run: `bound` set (the port is taken), then it waits for the models' load and
    records the app built, the host and the port, as a server stopped once loaded."""

    def run(server):
        if bound is not None:
            bound.set()
        assert server.config.app.loaded.wait(60)
        ran.update(app=server.config.app.app, host=server.config.host, port=server.config.port)

    return run


def test_serve_command_builds_one_generator_and_binds_loopback(monkeypatch, generator):
    import specdec_exact.generator

    built, ran = [], {}
    monkeypatch.setattr(specdec_exact.generator, "SpeculativeGenerator",
                        lambda *args, **kw: built.append(args) or generator)
    monkeypatch.setattr(uvicorn.Server, "run", served_when_loaded(ran))
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    server.add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--target", "some/model", "--draft", "none", "--max-queue", "3"])
    assert args.func(args) == 0
    assert built == [("some/model", None)]
    assert (ran["host"], ran["port"]) == ("127.0.0.1", 8000)
    service = ran["app"].state.service
    assert (service.model_name, service.scheduler.max_queue) == ("some/model", 3)


# ---- the load generator (python -m benchmarks load)


def test_load_generator_drives_both_servers_and_checks_every_answer(generator, tmp_path):
    from benchmarks import load

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

    from benchmarks import load

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
    from benchmarks import load

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
    from conftest import ALPHABET, DRAFT_MERGES, TARGET_MERGES, byte_bpe_tokenizer

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


# ---- one request's failure, its limits and its deadline


POISON = "poisoned prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_sequence_fails_only_its_own_request(generator, monkeypatch, stream, caplog):
    """A fault in one sequence's target pass, while seven others decode beside it in one batch: that request gets an
    error it can act on (a 500 naming the fault, or mid-stream an error event and the end of the stream), the seven
    get exactly the tokens they get without the fault, and the server goes on serving."""
    from specdec_exact.runtimes.pytorch import TorchRunner

    jobs = [dict(prompt=f"job {i}:", max_tokens=30, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(7)]
    expected = [generator.generate(j["prompt"], max_new_tokens=30, temperature=j["temperature"],
                                   seed=j["seed"]).token_ids for j in jobs]
    poison_ids = generator.encode(POISON)
    assert len(generator.generate(POISON, max_new_tokens=30).token_ids) > 8  # it gets far enough to fail mid-way
    forward = TorchRunner.forward

    def faulty(runner, input_ids, *args, **kwargs):
        if runner.model is generator.target:
            if runner.length == 0:
                runner.prompt_ids = input_ids[0].tolist()
            if getattr(runner, "prompt_ids", None) == poison_ids and runner.length > len(poison_ids) + 4:
                raise RuntimeError("injected fault in the target's pass")
        return forward(runner, input_ids, *args, **kwargs)

    monkeypatch.setattr(TorchRunner, "forward", faulty)

    def ask(base, job):
        body = {"model": MODEL, "return_token_ids": True, "stream": stream, **job}
        if not stream:
            return httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            return response.status_code, [line for line in response.iter_lines() if line]

    with forward_hook(generator.target, lambda *args: time.sleep(0.005)), \
            serve(create_app(generator, MODEL, max_batch=8)) as base, ThreadPoolExecutor(8) as pool:
        poisoned = pool.submit(ask, base, dict(prompt=POISON, max_tokens=30, temperature=0))
        others = [pool.submit(ask, base, job) for job in jobs]
        answers, failed = [o.result(30) for o in others], poisoned.result(30)
        if stream:
            status, lines = failed
            assert status == 200 and lines[0].startswith("data: {") and "[DONE]" not in lines[-1]
            error = json.loads(lines[-1][len("data: "):])["error"]
            assert all("error" not in json.loads(line[len("data: "):]) for line in lines[:-1])
            tokens = [[t for line in lines[:-1] for t in json.loads(line[len("data: "):])["choices"][0]["token_ids"]]
                      for _, lines in answers]
            assert all(status == 200 and lines[-1] == "data: [DONE]" for status, lines in answers)
        else:
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert all(a.status_code == 200 for a in answers)
            tokens = [a.json()["choices"][0]["token_ids"] for a in answers]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        assert "RuntimeError" in error["message"] and "injected" not in error["message"]  # its text: the log's
        incident = error["message"].rsplit(" ", 1)[-1]
        assert f"incident {incident}" in caplog.text and "injected fault in the target's pass" in caplog.text
        assert tokens == expected
        wait_for(lambda: pending(base) == 0)
        again = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "xy", "max_tokens": 3,
                                                           "temperature": 0}, timeout=10)
        assert again.json()["choices"][0]["text"] == generator.generate("xy", max_new_tokens=3).text


def test_a_failing_batch_cycle_ends_its_requests_and_the_scheduler_goes_on(generator, monkeypatch, caplog):
    """A cycle that fails as a whole (not one sequence's failure) ends the requests in it with a 500 naming the fault;
    the model's thread survives it and serves the next request."""
    from specdec_exact.batching import Batch

    fail_once(monkeypatch, Batch, "step", RuntimeError("injected fault in the batch"), lambda batch: batch.active)
    with serve(create_app(generator, MODEL)) as base:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0}
        failed = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert failed.status_code == 500 and "RuntimeError" in failed.json()["error"]["message"]
        assert "injected fault in the batch" not in failed.text and "injected fault in the batch" in caplog.text
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert again.json()["choices"][0]["text"] == generator.generate("ab", max_new_tokens=8).text
        assert pending(base) == 0


def test_a_fault_outside_a_batch_step_ends_the_requests_in_flight_and_the_model_thread_goes_on(generator,
                                                                                              monkeypatch):
    """A fault of the model's thread between steps (here as a request leaves the batch): the request in the batch
    gets a 500 naming it at once (not a 504 after the request timeout), the thread serves the next request, and the
    fault is counted in /metrics while /health stays 200."""
    from specdec_exact.server.scheduler import Scheduler

    fail_once(monkeypatch, Scheduler, "_leave", RuntimeError("injected fault as a request leaves"),
              lambda scheduler: scheduler._active)
    with serve(create_app(generator, MODEL)) as base, \
            forward_hook(generator.target, lambda *args: time.sleep(0.01)):  # still decoding at the next cycle
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0}
        failed = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert failed.status_code == 500 and "RuntimeError" in failed.text and "incident" in failed.text
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert again.json()["choices"][0]["text"] == generator.generate("ab", max_new_tokens=8).text
        assert httpx.get(f"{base}/health").status_code == 200 and pending(base) == 0
        assert metric(base, "specdec_model_thread_faults") == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected end, on purpose
def test_a_model_thread_that_ends_makes_health_503_and_the_next_request_starts_it_again(generator, monkeypatch):
    """If the model's thread ends (an error that is not an Exception), the request it held ends with a 500, /health
    says 503 and why (a load balancer stops sending), and the next request starts a new thread and is answered."""
    from specdec_exact.server.scheduler import Scheduler

    fail_once(monkeypatch, Scheduler, "_cycle", SystemExit("injected end of the model's thread"),
              lambda scheduler: scheduler._active)
    with serve(create_app(generator, MODEL)) as base:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0}
        failed = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert failed.status_code == 500 and "incident" in failed.text
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 503)
        health = httpx.get(f"{base}/health").json()
        assert health["status"] == "error" and "SystemExit" in health["reason"]
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert again.json()["choices"][0]["text"] == generator.generate("ab", max_new_tokens=8).text
        assert httpx.get(f"{base}/health").json()["status"] == "ok"


def test_a_value_error_inside_the_server_is_a_500_not_a_400_blaming_the_client(generator, monkeypatch):
    """Only a refusal of the request itself (it does not fit in the context) answers 400; a ValueError raised while
    the server starts a request that was fine is the server's fault, answered with 500."""
    from specdec_exact.batching import Batch

    add = Batch.add

    def failing_add(batch, request):
        raise ValueError("injected: a bug in starting the request")

    monkeypatch.setattr(Batch, "add", failing_add)
    with serve(create_app(generator, MODEL)) as base:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0}
        failed = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        monkeypatch.setattr(Batch, "add", add)
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=10).status_code == 200


def test_ctx_size_is_the_limit_prompts_are_checked_against_and_is_reported(generator, url):
    """--ctx-size below the trained context: a prompt that fits the trained context but not this limit is refused,
    naming the limit; /v1/models reports it; a chat request without max_tokens gets what is left of it."""
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == generator.context_length  # memory
    with serve(create_app(generator, MODEL, ctx_size=64)) as base:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 64
        assert httpx.get(f"{base}/v1/models/{MODEL}").json()["max_model_len"] == 64
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "a" * 100, "max_tokens": 1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt") and "64" in error["message"]
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "a" * 40, "max_tokens": 30})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        assert "at most 24 new tokens" in response.json()["error"]["message"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "temperature": 0})
        assert chat.status_code == 200
        n_prompt = len(generator.encode("hello", chat=True))
        ref = generator.generate("hello", chat=True, max_new_tokens=64 - n_prompt)
        assert chat.json()["usage"]["completion_tokens"] == len(ref.token_ids) <= 64 - n_prompt
    for too_big in (generator.context_length + 1, 10**9):
        with pytest.raises(ValueError, match="--ctx-size"):
            create_app(generator, MODEL, ctx_size=too_big)


def test_ctx_size_flag_reaches_the_app_and_a_bad_one_is_refused_at_start(monkeypatch, generator, capsys):
    import specdec_exact.generator
    from specdec_exact.cli import main

    ran, bound = {}, threading.Event()

    def load(*args, **kw):  # the models load only once the port is bound
        assert bound.wait(30), "the models were loaded before the server bound its port"
        return generator

    monkeypatch.setattr(specdec_exact.generator, "SpeculativeGenerator", load)
    monkeypatch.setattr(uvicorn.Server, "run", served_when_loaded(ran, bound))
    serve_ = ["serve", "--target", "some/model", "--draft", "none"]
    assert main([*serve_, "--ctx-size", "100", "--request-timeout", "5"]) == 0
    assert ran["app"].state.service.context == 100
    assert ran["app"].state.service.scheduler.request_timeout == 5
    assert "each of up to 100 tokens (--ctx-size)" in capsys.readouterr().err
    assert main([*serve_, "--ctx-size", str(generator.context_length + 1)]) == 2
    error = capsys.readouterr().err
    assert "--ctx-size" in error and f"trained context of {generator.context_length} tokens" in error
    assert "Traceback" not in error
    assert main([*serve_, "--request-timeout", "0"]) == 2
    assert "--request-timeout must be > 0 seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "(default: what memory allows" in " ".join(capsys.readouterr().out.split())


def test_a_starting_server_answers_503_with_its_progress_until_its_app_is_built(generator):
    """The port is bound before the models load: /health says what is being done and how far it is, the API routes
    answer 503 in OpenAI's shape, then every request reaches the built app. A load that fails stops the server."""
    from specdec_exact import progress
    from specdec_exact.server.starting import Starting

    calibrating, release = threading.Event(), threading.Event()

    def build():
        with progress.step("calibrating tiny.gguf: the cost of a pass of each width", total=4, unit="width") as step:
            step.advance()
            calibrating.set()
            assert release.wait(30)
        return create_app(generator, MODEL)

    starting = Starting(MODEL)
    with serve(starting) as base:
        starting.start(build)
        assert calibrating.wait(30)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        body = health.json()
        assert body["status"] == "calibrating" and body["model"] == MODEL
        assert [(s["step"], s["done"], s["total"]) for s in body["progress"]["steps"]] == [
            ("calibrating tiny.gguf: the cost of a pass of each width", 1, 4)]
        refused = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_starting"
        assert "calibrating tiny.gguf" in refused.json()["error"]["message"]
        release.set()
        assert starting.loaded.wait(30) and starting.failure is None
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        answer = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2,
                                                             "temperature": 0})
        expected = generator.generate("ab", max_new_tokens=2).token_ids  # (greedy: a sample may end at once)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == len(expected) > 0

    stopped = threading.Event()
    failing = Starting(MODEL)
    failing.load(lambda: (_ for _ in ()).throw(ValueError("--ctx-size too large")), on_failure=stopped.set)
    assert stopped.is_set() and isinstance(failing.failure, ValueError) and failing.app is None


def test_an_api_key_file_gives_several_keys_and_a_bad_one_is_refused_before_loading(generator, tmp_path):
    from specdec_exact.server.command import api_keys, check_serve_args, serve_arguments

    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nalice-key\n\n  bob-key  \n")
    args = serve_arguments(["--api-key", "ops-key", "--api-key-file", str(keys)])
    assert api_keys(args) == ["ops-key", "alice-key", "bob-key"]
    with serve(create_app(generator, MODEL, api_key=api_keys(args))) as base:
        for key in ("ops-key", "alice-key", "bob-key"):
            assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for wrong in ("# one key a line", "carol-key", "alice-key bob-key", "ops-keyalice-key"):
            assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    for path, says in [(tmp_path / "empty", "holds no key"), (tmp_path / "missing", "cannot read it")]:
        with pytest.raises(ValueError, match=says):
            check_serve_args(serve_arguments(["--api-key-file", str(path)]))


def test_an_unauthenticated_upload_gets_401_before_its_body_is_read(generator):
    """Authentication comes before the body limit: a client without the key gets 401 and the server never reads (let
    alone buffers) its chunked body, however large."""
    import asyncio

    from specdec_exact.server import MAX_BODY_BYTES

    app = create_app(generator, MODEL, api_key=KEY)
    reads, sent = [], []

    async def receive():  # a chunked body of more than MAX_BODY_BYTES, 1 MiB at a time
        reads.append(2**20)
        return {"type": "http.request", "body": b" " * 2**20, "more_body": sum(reads) <= MAX_BODY_BYTES}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    assert reads == []


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_ends_a_generating_request(generator, stream):
    """--request-timeout: a request still generating after it gets 504 in OpenAI's shape (mid-stream: an error event,
    then the end of the stream) and leaves the batch."""
    assert generator.generate("a", max_new_tokens=200).stats.target_calls > 30  # slowed below: over 0.9 s
    body = {"model": MODEL, "prompt": "a", "max_tokens": 200, "temperature": 0, "stream": stream}
    with forward_hook(generator.target, lambda *args: time.sleep(0.03)), \
            serve(create_app(generator, MODEL, request_timeout=0.6)) as base:
        started = time.monotonic()
        if stream:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                lines = [line for line in response.iter_lines() if line]
            assert len(lines) > 1 and all("error" not in json.loads(line[len("data: "):]) for line in lines[:-1])
            error = json.loads(lines[-1][len("data: "):])["error"]  # the last event: no [DONE] after it
        else:
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert response.status_code == 504
            error = response.json()["error"]
        assert 0.6 <= time.monotonic() - started < 3
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout"
        assert "0.6 s" in error["message"]
        wait_for(lambda: pending(base) == 0, timeout=5)


def test_request_timeout_ends_queued_requests_even_while_a_cycle_hangs(generator):
    """The deadline is kept by the event loop too: while the model's thread is stuck in one pass, the request in the
    batch and the one queued behind it both get 504 on time; once the pass returns, both have left the scheduler."""
    gate, calls = threading.Event(), []

    def stuck_after_a_few_cycles(*args):
        calls.append(1)
        if len(calls) > 4:
            gate.wait(20)

    body = {"model": MODEL, "prompt": "a", "max_tokens": 200, "temperature": 0}
    with serve(create_app(generator, MODEL, max_batch=1, request_timeout=0.8)) as base, \
            forward_hook(generator.target, stuck_after_a_few_cycles), ThreadPoolExecutor(2) as pool:
        try:
            started = time.monotonic()
            generating = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=30)
            wait_for(lambda: len(calls) > 4)
            queued = pool.submit(httpx.post, f"{base}/v1/completions", json={**body, "prompt": "b"}, timeout=30)
            wait_for(lambda: pending(base) == 2)
            for response in (generating.result(10), queued.result(10)):
                assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
            assert time.monotonic() - started < 3
            assert pending(base) == 1  # the queued one has left; the stuck one leaves after its pass
        finally:
            gate.set()
        wait_for(lambda: pending(base) == 0, timeout=5)
        assert len(calls) < 10  # it did not go on generating


@pytest.mark.parametrize("chat", [False, True])
def test_max_tokens_zero_answers_with_usage_and_runs_no_target_pass(client, generator, chat):
    calls = []
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    with forward_hook(generator.target, lambda *args: calls.append(1)):
        out = create(model=MODEL, max_tokens=0, temperature=0, extra_body=STATS, **prompt)
    text = out.choices[0].message.content if chat else out.choices[0].text
    assert text == "" and out.choices[0].finish_reason == "length"
    n_prompt = len(generator.encode("hello", chat=chat))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 0, n_prompt)
    assert calls == [] and out.model_extra["specdec"]["target_calls"] == 0


def test_the_event_loop_answers_while_a_chat_template_renders(url, generator, monkeypatch):
    """The chat template and the tokenizer run in a worker thread: /health answers while a template is rendering."""
    entered, release = threading.Event(), threading.Event()
    apply = type(generator.tokenizer).apply_chat_template

    def slow_template(self, *args, **kwargs):
        entered.set()
        release.wait(10)
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(type(generator.tokenizer), "apply_chat_template", slow_template)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=30)
        assert entered.wait(10)
        try:
            started = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
            assert time.monotonic() - started < 2 and not chat.done()
        finally:
            release.set()
        assert chat.result(30).status_code == 200


# ---- what fits in memory


def test_ctx_size_and_max_batch_are_decided_by_the_kv_cache_that_fits():
    from specdec_exact.server.limits import MEMORY_SHARE, MIN_CTX_SIZE, choose_ctx_size

    kib, gib = 2**10, 2**30
    fits = dict(kv_bytes_per_token=128 * kib, trained_context=32768, max_batch=8)  # 1 MiB per token of the batch
    budget_tokens = int(8 * gib * MEMORY_SHARE) // (2**20)
    # The default: the largest multiple of 256 tokens whose caches fit in the share of the available memory.
    assert choose_ctx_size(None, available_bytes=8 * gib, **fits) == budget_tokens // 256 * 256
    assert choose_ctx_size(None, available_bytes=8 * gib + 300 * 2**20 / MEMORY_SHARE, **fits) == budget_tokens + 256
    # ... capped at the trained context, which need not be a multiple of 256.
    assert choose_ctx_size(None, available_bytes=10**6 * gib, **{**fits, "trained_context": 1000}) == 1000
    assert choose_ctx_size(None, available_bytes=None, **fits) == 32768  # memory unknown: the trained context
    # An explicit --ctx-size is kept when it fits, refused when the trained context or the memory cannot hold it.
    assert choose_ctx_size(300, available_bytes=8 * gib, **fits) == 300
    with pytest.raises(ValueError, match=r"--ctx-size 40000 exceeds the target's trained context of 32768 tokens"):
        choose_ctx_size(40000, available_bytes=10**6 * gib, **fits)
    with pytest.raises(ValueError, match=rf"--ctx-size {budget_tokens} or less.*or a smaller --max-batch"):
        choose_ctx_size(budget_tokens + 1, available_bytes=8 * gib, **fits)
    with pytest.raises(ValueError, match="--ctx-size must be at least 2"):
        choose_ctx_size(1, available_bytes=8 * gib, **fits)
    # --max-batch: refused when even the minimum context does not fit that many requests, saying how many would.
    small = int(MIN_CTX_SIZE * 8 * 128 * kib / MEMORY_SHARE) - 1  # a byte short of 8 requests of MIN_CTX_SIZE
    with pytest.raises(ValueError, match=r"--max-batch 8: .* use --max-batch 7 or less, or a smaller --ctx-size"):
        choose_ctx_size(None, available_bytes=small, **fits)
    assert choose_ctx_size(None, available_bytes=small, **{**fits, "max_batch": 7}) >= MIN_CTX_SIZE
    with pytest.raises(ValueError, match="--max-batch 8"):
        choose_ctx_size(MIN_CTX_SIZE, available_bytes=small, **fits)
    assert choose_ctx_size(256, available_bytes=small, **fits) == 256  # a smaller --ctx-size fits them all
    # A trained context below the minimum is the default when it fits.
    assert choose_ctx_size(None, available_bytes=8 * gib, **{**fits, "trained_context": 256}) == 256


def test_the_prompt_cache_and_a_prefills_copies_count_against_the_memory_for_the_kv_caches():
    """The prompt cache's budget comes out of the share of memory the KV caches may take, and a prefill through it
    copies a sequence's KV state PREFILL_COPIES times: a context that fits without the cache is refused with it,
    saying which flags to change. Negative control: without a prompt cache, the same context fits."""
    from specdec_exact.server.limits import MEMORY_SHARE, PREFILL_COPIES, choose_ctx_size

    mib, gib = 2**20, 2**30
    fits = dict(kv_bytes_per_token=mib // 8, trained_context=32768, max_batch=8, available_bytes=16 * gib)
    share = int(16 * gib * MEMORY_SHARE)
    cache = gib
    with_cache = (share - cache) // (mib // 8 * (8 + PREFILL_COPIES))
    assert choose_ctx_size(None, prompt_cache_bytes=cache, **fits) == with_cache // 256 * 256
    assert choose_ctx_size(None, **fits) == share // mib // 256 * 256 > with_cache
    assert choose_ctx_size(with_cache + 1, **fits) == with_cache + 1  # fits without the cache ...
    with pytest.raises(ValueError, match=r"less the prompt cache's 1\.0 GiB \(--prompt-cache-mb\).*use --ctx-size"):
        choose_ctx_size(with_cache + 1, prompt_cache_bytes=cache, **fits)  # ... not with it
    with pytest.raises(ValueError, match=r"or --prompt-cache-mb"):  # a cache that leaves no room at all
        choose_ctx_size(None, prompt_cache_bytes=share, **fits)


def test_available_memory_reads_memavailable(tmp_path):
    from specdec_exact.server.limits import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16303404 kB\nMemFree:         1045304 kB\nMemAvailable:    9512340 kB\n")
    assert available_memory(meminfo) == 9512340 * 1024
    assert available_memory(tmp_path / "missing") is None


def test_suffix_lookup_in_the_server_drafts_from_earlier_requests_and_a_seeded_sample_drafts_as_alone():
    """Every request's drafter is a fork that shares suffix lookup's history: the second time a prompt comes (to the
    batched server), its first answer is in the history and drafted in long accepted runs. A seeded sample does not
    read that history, so it drafts what it would alone and gives the same sample."""
    gen = SpeculativeGenerator(tiny_model("qwen2", seed=0, vocab_size=60), "suffix", k=8, tokenizer=char_tokenizer())
    prompt = "abcabd"
    with serve(create_app(gen, MODEL, max_batch=4)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)

        def stats(**settings):
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body=STATS, **settings)
            return reply.choices[0].text, reply.model_extra["specdec"]

        first_text, first = stats(temperature=0)
        again_text, again = stats(temperature=0)
        seeded = [stats(temperature=0.8, seed=5) for _ in range(2)]
    assert again_text == first_text
    assert again["accepted_tokens"] > first["accepted_tokens"] and again["cycles"] < first["cycles"]
    counts = [(text, s["cycles"], s["drafted_tokens"], s["accepted_tokens"]) for text, s in seeded]
    assert counts[0] == counts[1]  # the second did not draft from the first's answer
    alone = SpeculativeGenerator(gen.target, "suffix", k=8, tokenizer=gen.tokenizer).generate(
        prompt, max_new_tokens=24, temperature=0.8, seed=5)
    assert seeded[0][0] == alone.text
