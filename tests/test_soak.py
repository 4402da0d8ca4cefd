"""Faults under load: 16 clients on a loopback server for a bounded time, some leaving mid-stream, one request timing
out, a fault of the model's thread injected. The server must stay up and tell the truth on /health, answer every
request it finishes as the same request alone, count no 5xx but the injected fault's, leave nothing hanging, and keep
its memory in bounds."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from specdec_exact import SpeculativeGenerator
from specdec_exact.server import create_app
from specdec_exact.server.scheduler import Scheduler

from conftest import char_tokenizer, close_draft, serve, tiny_model

MODEL = "tiny-qwen2"
CLIENTS = 16
SOAK_S = 12.0
# The server's request timeout. The long request below (the end of text barred, up to 4,000 tokens) cannot finish
# within it, and a short one (about 6 cycles) finishes well within it even on a busy machine, each cycle shared with
# the batch's other requests. On this suite's 2-core machine, beside another test process, short requests queued
# behind the batch timed out with 2 s of timeout, and again with 4 s (5 of ~200, in make test on a Zen 4, family 25
# model 17, when the long request was up to 1,000 tokens)
TIMEOUT_S = 8.0
PROMPTS = ["ab", "hello", "xyz", "abcabc", "qwerty", "lorem ipsum"]
LONG = {"prompt": "z", "max_tokens": 4000, "temperature": 1.0, "seed": 5,
        "logit_bias": {str(char_tokenizer().eos_token_id): -100}}
CONTEXT = 4096  # the tiny target's: room for the long request


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one_client(base: str, number: int, stop: threading.Event, outcomes: list, lock: threading.Lock) -> None:
    """Requests until stop: greedy completions (whole or streamed), and every fifth one a stream it leaves after its
    second event."""
    rng = random.Random(number)
    with httpx.Client(base_url=base, timeout=60) as http:
        for turn in range(10**6):
            if stop.is_set():
                return
            prompt, max_tokens = rng.choice(PROMPTS), rng.randint(4, 16)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if turn % 5 == 4:  # a client that leaves mid-stream
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    for index, _ in enumerate(response.iter_lines()):
                        if index == 1:
                            break
                outcome = ("left", response.status_code, None)
            elif turn % 2:
                events, text = [], ""
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    status = response.status_code
                    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
                if status == 200 and events[-1:] == ["[DONE]"]:
                    text = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1]
                                   if json.loads(event)["choices"])
                    outcome = ("answered", 200, (prompt, max_tokens, text))
                else:  # an error event mid-stream (the injected fault), or a refusal
                    outcome = ("failed", status if status != 200 else 500, events[-1:])
            else:
                response = http.post("/v1/completions", json=body)
                if response.status_code == 200:
                    outcome = ("answered", 200, (prompt, max_tokens, response.json()["choices"][0]["text"]))
                else:
                    outcome = ("failed", response.status_code, response.json()["error"])
            with lock:
                outcomes.append(outcome)


def test_sixteen_clients_with_faults_leave_the_server_up_exact_and_idle(monkeypatch):
    target = tiny_model("qwen2", seed=0, vocab_size=60, max_positions=CONTEXT)
    tokenizer = char_tokenizer()
    generator = SpeculativeGenerator(target, close_draft(target), k=3, tokenizer=tokenizer, draft_tokenizer=tokenizer)
    alone = {(p, n): generator.generate(p, max_new_tokens=n).text for p in PROMPTS for n in range(4, 17)}

    # The fault: the model's thread fails once between steps, some seconds in, while requests are in flight
    real_leave, injected = Scheduler._leave, threading.Event()
    # The fault strikes once the long request has timed out (a fault while it was in flight ended it with the fault's
    # 500, on a slow run), a third of the way through the soak at the earliest
    fault_at, armed = time.monotonic() + SOAK_S / 3, threading.Event()

    def leave(scheduler):
        if not injected.is_set() and scheduler._active and armed.is_set() and time.monotonic() > fault_at:
            injected.set()
            raise RuntimeError("injected fault of the model's thread")
        return real_leave(scheduler)

    monkeypatch.setattr(Scheduler, "_leave", leave)
    handle = target.register_forward_hook(lambda *args: time.sleep(0.004))  # every step of the target slowed
    outcomes, lock, stop = [], threading.Lock(), threading.Event()
    try:
        with serve(create_app(generator, MODEL, max_batch=4, max_queue=64, request_timeout=TIMEOUT_S)) as base:
            before = rss_bytes()
            clients = [threading.Thread(target=one_client, args=(base, i, stop, outcomes, lock))
                       for i in range(CLIENTS)]
            for client in clients:
                client.start()
            time.sleep(1.0)
            long = httpx.post(f"{base}/v1/completions", json={"model": MODEL, **LONG}, timeout=60)
            armed.set()
            health_during = httpx.get(f"{base}/health", timeout=10)
            time.sleep(max(0.0, SOAK_S - 1.0))
            stop.set()
            for client in clients:
                client.join(60)
            assert not any(client.is_alive() for client in clients), "a client hangs"
            deadline = time.monotonic() + 15
            while httpx.get(f"{base}/health").json()["pending"] and time.monotonic() < deadline:
                time.sleep(0.05)
            health = httpx.get(f"{base}/health")
            grown = rss_bytes() - before
            faults = httpx.get(f"{base}/metrics").text
    finally:
        handle.remove()

    kinds = Counter(kind for kind, _, _ in outcomes)
    statuses = Counter(status for kind, status, _ in outcomes if kind == "failed")
    summary = (dict(kinds), dict(statuses))
    print(f"soak: {len(outcomes) + 1} requests from {CLIENTS} clients in {SOAK_S:g} s: {dict(kinds)}, failed by status "
          f"{dict(statuses)}, the long one {long.status_code}; memory grew {grown / 2**20:.0f} MiB")
    assert kinds["answered"] >= 4 * CLIENTS and kinds["left"] >= CLIENTS, summary
    # Every answer equals the same request alone, greedy
    wrong = [(p, n, text) for kind, _, answer in outcomes if kind == "answered"
             for p, n, text in [answer] if text != alone[(p, n)]]
    assert not wrong, wrong[:3]
    # No 5xx but the injected fault's (the requests in flight when it struck: at most a batch), and no timeouts of
    # the short requests
    assert injected.is_set()
    assert set(statuses) <= {500} and statuses[500] <= 4, summary
    assert "specdec_model_thread_faults 1.0" in faults
    # The long request timed out in OpenAI's shape; /health told the truth during the soak and after it
    assert long.status_code == 504 and long.json()["error"]["code"] == "request_timeout"
    assert health_during.status_code == 200
    assert health.status_code == 200 and health.json()["pending"] == 0 and health.json()["batch"] == 0
    assert grown < 300 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB"
