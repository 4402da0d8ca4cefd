"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: a live server (uvicorn on loopback, the API key
on, a tiny model) gets requests generated from every operation's schema, valid ones and ones that break it. None may
answer 5xx or hang, and every 4xx must be an OpenAI-style error that says what was wrong."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from conftest import char_tokenizer, close_draft, serve, tiny_model
from specdec_exact import SpeculativeGenerator
from specdec_exact.server import create_app

MODEL = "tiny-qwen2"
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
EXAMPLES = 40  # per operation and mode
CALL_TIMEOUT_S = 60  # far more than any request of the tiny model takes: a call that runs out of it hung


@pytest.fixture(scope="module")
def fuzzed_url():
    target = tiny_model("qwen2", seed=0, vocab_size=60)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    generator = SpeculativeGenerator(target, close_draft(target), k=3, tokenizer=tokenizer, draft_tokenizer=tokenizer)
    with serve(create_app(generator, MODEL, api_key=KEY)) as url:
        yield url


def is_openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"].strip()) \
        and isinstance(error.get("type"), str)


def test_the_error_shape_check_can_fail():
    """The negative control of the check below: FastAPI's own 422 body is not an OpenAI error."""
    assert not is_openai_error({"detail": [{"loc": ["body", "max_tokens"], "msg": "bad"}]})
    assert not is_openai_error({"error": {"message": " ", "type": "invalid_request_error"}})
    assert is_openai_error({"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error"}})


def served_model(case):
    """A valid case asks for the served model (any other name is a 404 before anything else is looked at)."""
    if case.operation.label.startswith("POST") and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def operations(fuzzed_url):
    schema = schemathesis.openapi.from_url(f"{fuzzed_url}/openapi.json", headers=AUTH)
    return [result.ok() for result in schema.get_all_operations()]


# (schemathesis's own pytest plugin does not run under this pytest, so each operation's cases come from its
# hypothesis strategy here)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx_or_hangs_and_every_4xx_says_why(fuzzed_url, mode):
    found = operations(fuzzed_url)
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= {op.label for op in found}

    calls, unbreakable = [], []
    for operation in found:
        cases = operation.as_strategy(generation_mode=mode)
        @given(case=cases.map(served_model) if mode is GenerationMode.POSITIVE else cases)
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)  # the same cases on every run: a failure in CI is one to reproduce
        def check(case):
            response = case.call(base_url=fuzzed_url, headers=AUTH, timeout=CALL_TIMEOUT_S)
            calls.append((operation.label, response.status_code))
            case.validate_response(response, checks=[not_a_server_error])
            if 400 <= response.status_code < 500:
                assert is_openai_error(response.json()), (response.status_code, response.text[:500])

        try:
            check()
        except Unsatisfiable:  # no request breaks its schema (no input, or any string goes)
            assert mode is GenerationMode.NEGATIVE, operation.label
            unbreakable.append(operation.label)
    assert not {"POST /v1/completions", "POST /v1/chat/completions"} & set(unbreakable)
    assert len(calls) >= len(found) - len(unbreakable)
    posts = [status for label, status in calls if label.startswith("POST")]
    if mode is GenerationMode.NEGATIVE:  # requests that break the schema are refused, not answered
        assert posts and all(400 <= status < 500 for status in posts), posts
    else:  # and valid ones reach the model: the fuzzing got past the model name and the body checks
        assert posts.count(200) >= 10, posts
