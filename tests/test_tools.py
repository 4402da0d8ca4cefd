"""Tool calls in the Hermes format (Qwen2.5's chat template): the format read from a template, calls parsed from a
whole answer and from a stream as it comes, and the grammar of a required call."""

from __future__ import annotations

import json

import pytest

from specdec_exact.grammar import GrammarError
from specdec_exact.tools import HERMES, ToolStream, tool_format

QWEN_LIKE = ("{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> Call them as "
             "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
             "{% for m in messages %}{{ m['content'] }}{% endfor %}")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_the_format_is_read_from_the_template():
    assert tool_format(QWEN_LIKE) is HERMES
    assert tool_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None  # takes no tools
    assert tool_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}") is None  # another format: refused
    assert tool_format(None) is None


def test_a_whole_answer_is_parsed_into_its_calls_and_the_text_around_them():
    content, calls = HERMES.parse(f"Let me add.\n{CALL}\n{CALL.replace('add', 'sub')}")
    assert content == "Let me add." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("sub", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and calls[0].as_openai(0)["function"]["name"] == "add"
    assert HERMES.parse(CALL)[0] is None  # nothing but the call
    for text in ("no call here", "<tool_call>\n{not json}\n</tool_call>", '<tool_call>{"name": "add"',
                 '<tool_call>["add"]</tool_call>'):
        assert HERMES.parse(text) == (text, [])  # not a call: it stays text


def test_a_stream_lets_text_through_until_a_call_may_begin_and_reads_the_calls_at_the_end():
    stream, sent = ToolStream(HERMES), []
    for piece in ["Let me ", "add.\n<tool", "_call>\n{\"name\": \"add\", ", "\"arguments\": {\"a\": 1, \"b\": 2}}",
                  "\n</tool_call>"]:
        sent.append(stream.feed(piece))
    assert "".join(sent) == "Let me add.\n" and "<" not in "".join(sent)
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["add"]
    plain = ToolStream(HERMES)
    text = "".join(plain.feed(piece) for piece in ["a < b, and ", "<tool"])
    assert text == "a < b, and " and plain.finish() == ("<tool", [])  # a tag's start that never became a call


def test_a_required_call_is_a_grammar_over_the_offered_functions():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert "add" in HERMES.grammar(tools, None, True).source
    assert HERMES.grammar(tools, "add", False).what == "a call to 'add'"
    with pytest.raises(GrammarError, match="not among the tools"):
        HERMES.grammar(tools, "sub", False)


@pytest.mark.real_model  # the default target's tokenizer and chat template
def test_the_default_targets_template_teaches_the_hermes_format_and_takes_calls_back_in_the_history():
    """Qwen2.5's own chat template: read as Hermes style; the tools rendered into its system turn; an assistant's
    call and the tool's answer rendered back as <tool_call> and <tool_response>; a required call's grammar builds
    with <tool_call> as the tokenizer's own token."""
    from transformers import AutoTokenizer

    from conftest import require
    from specdec_exact import registry

    require(registry.gguf_ready(registry.DEFAULT_TARGET), f"{registry.DEFAULT_TARGET} is not pulled: make models")
    path = registry.gguf_file(registry.DEFAULT_TARGET, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(registry.gguf_tokenizer_dir(path), local_files_only=True)
    assert tool_format(tokenizer.chat_template) is HERMES
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "1 + 2?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
               {"role": "tool", "content": "3"}]
    text = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    added = frozenset(token.content for token in tokenizer.added_tokens_decoder.values())
    assert "<tool_call>" in added and "<tool_call> " in HERMES.grammar(tools, None, False, added).source
