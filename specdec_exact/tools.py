"""Tool calls: the tools a chat request offers go through the target's own chat template, and the calls the model
writes come back parsed, in the format that template teaches it.

The format is read from the template, not assumed: a template that asks for calls inside <tool_call></tool_call> tags
(Hermes style: Qwen2.5, Hermes, and the many templates that copied them) gets HERMES; a template that takes tools in
another way is refused rather than parsed wrongly. A required call (tool_choice "required" or a named function) is a
grammar (specdec_exact.grammar): the output must be one call, or several with parallel_tool_calls, each to an offered
function with arguments that follow its JSON schema, so the forced call is exact under speculation as any grammar is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from specdec_exact.grammar import Grammar, GrammarError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolFormat:
    """How a template's model writes a call: `start`, a JSON object {"name": ..., "arguments": {...}}, `end`."""

    name: str
    start: str
    end: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer -> (its text outside the calls, stripped, None if nothing is left; the calls). A block that
        is not such a call (unclosed, or not JSON of that shape) stays in the text."""
        calls, kept, at = [], [], 0
        for match in re.finditer(re.escape(self.start) + r"\s*(.*?)\s*" + re.escape(self.end), text, re.DOTALL):
            call = self._call(match.group(1))
            if call is None:
                continue
            kept.append(text[at:match.start()])
            at = match.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept).strip()
        return content or None, calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            found = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(found, dict) and isinstance(found.get("name"), str)
                and isinstance(found.get("arguments", {}), dict)):
            return None
        return ToolCall(found["name"], json.dumps(found.get("arguments", {}), ensure_ascii=False))

    def grammar(self, tools: list[dict], only: str | None, parallel: bool, tokens: frozenset[str] = frozenset()
                ) -> Grammar:
        """Output that is a call to one of `tools` (OpenAI's {"type": "function", "function": {...}}; only: to the
        function of that name), or with `parallel` one or more calls, and nothing else. tokens: the texts the
        tokenizer has as tokens of their own (added tokens: a tag that is one must be written as that token)."""
        choices = []
        for tool in tools:
            function = tool["function"]
            if only is not None and function["name"] != only:
                continue
            choices.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                            "properties": {"name": {"const": function["name"]},
                                           "arguments": function.get("parameters") or {"type": "object"}}})
        if not choices:
            raise GrammarError(f"tool_choice names the function {only!r}, which is not among the tools")
        schema = json.dumps({"anyOf": choices} if len(choices) > 1 else choices[0])
        start, end = (tag if tag in tokens else json.dumps(tag) for tag in (self.start, self.end))
        call = f'{start} "\\n" %json {schema} "\\n" {end}'
        more = ' ("\\n" call)*' if parallel else ""  # (Lark: a newline between calls)
        lark = f"start: call{more}\ncall: {call}\n"
        return Grammar.lark(lark)._named(f"a call to {only!r}" if only else "a call to one of the tools")


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS = (HERMES,)


def tool_format(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template teaches its model to write calls in (None: it takes no tools, or in a way that
    specdec does not read)."""
    if not chat_template or "tools" not in chat_template:
        return None
    return next((form for form in FORMATS if form.start in chat_template and form.end in chat_template), None)


class ToolStream:
    """A streamed answer's text, let through as it comes until a call may have begun (its start tag, or text that
    could be the beginning of one), then held; at the end, the held text parsed into calls and what is left."""

    def __init__(self, form: ToolFormat):
        self.form, self.held, self.text = form, "", []

    def feed(self, text: str) -> str:
        """New text -> what can go to the client now as content."""
        self.held += text
        self.text.append(text)
        at = self.held.find(self.form.start)
        if at < 0:  # keep back a tail that could be the start tag's beginning
            at = next((i for i in range(max(0, len(self.held) - len(self.form.start) + 1), len(self.held))
                       if self.form.start.startswith(self.held[i:])), len(self.held))
        out, self.held = self.held[:at], self.held[at:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer -> (the content still to send, the calls)."""
        content, calls = self.form.parse(self.held)
        if not calls:
            return self.held, []
        return ("" if content is None else content), calls
