"""The request bodies of /v1/completions and /v1/chat/completions: strict types ("16" is not a number), unknown
fields kept so that the OpenAI options this server does not implement can be refused rather than ignored."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec_exact.adjust import MAX_BIAS, MAX_PENALTY, LogitAdjust
from specdec_exact.logprobs import MAX_TOP_LOGPROBS

MAX_CHOICES = 16  # n: choices one request may ask for

# OpenAI options this server does not implement, with the values that leave them off: others are refused, not ignored
# (top_logprobs is chat's: a completion asks with logprobs=N).
UNSUPPORTED = {"top_logprobs": (None, 0), "best_of": (None, 1),
               "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none")}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None


class Body(BaseModel):
    """What both endpoints take."""
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range; None -> 1.0, OpenAI's default; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # not OpenAI's; accepted as vLLM does
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what a torch.Generator takes
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices of one prompt (whole answers only)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # not OpenAI's: as vLLM, each choice also carries its "token_ids"
    return_speculation_stats: bool | None = None  # not OpenAI's: the answer carries its speculation stats, `specdec`
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None  # token id -> bias
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)

    def adjust(self) -> LogitAdjust | None:
        """The logit bias and penalties asked for (None: none). A key that is not a token id: ValueError."""
        bias = self.logit_bias or {}
        if any(not key.isdigit() for key in bias):
            raise ValueError(f"logit_bias maps token ids (as strings of digits) to biases; got the key(s) "
                             f"{[key for key in bias if not key.isdigit()][:3]}")
        if not (bias or self.presence_penalty or self.frequency_penalty):
            return None
        return LogitAdjust(tuple((int(key), value) for key, value in bias.items()), self.presence_penalty or 0.0,
                           self.frequency_penalty or 0.0)

    def logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return None

    def unsupported(self) -> str | None:
        """The first OpenAI option this body turns on that the server does not implement, if any."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                return name
        return None


class CompletionBody(Body):
    prompt: str | list[int]  # text, or token ids of the target's vocabulary
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's, with this many alternatives
    echo: bool | None = None  # the prompt comes back before the completion (with logprobs: its tokens' too)

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class Part(BaseModel):
    """A part of a body: strict types, and fields this server does not know kept (not refused)."""
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(Part):
    type: Literal["text"]
    text: str


class FunctionCall(Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(Part):
    """A call an earlier assistant message made (it comes back in the history)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": self.role, "content": content}
        if self.tool_calls:  # the templates take the arguments as an object (they write it out as JSON)
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionSpec(Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Part):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(Part):
    name: str


class NamedToolChoice(Part):
    type: Literal["function"]
    function: FunctionName


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # with this many alternatives (needs logprobs)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # a required call may be several (default: true, as OpenAI)

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
