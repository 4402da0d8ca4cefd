"""Response bodies in OpenAI's shapes (a whole completion, a stream's chunks, its usage chunk), and the server-sent
events of a streamed request, which free the model however the stream ends.

Responses carry OpenAI's fields, and `specdec` where the request asks for it (`"return_speculation_stats": true`):
the request's speculation stats (SpecStats.to_dict(): drafted and accepted tokens, acceptance rate, mean accepted
length, ...). A stream carries them on its last chunk before `data: [DONE]`, which is the usage chunk
(`choices: []`) when `stream_options.include_usage` asks for one. They are never sent unasked: how much of an answer
was drafted, and from where, says something of the text that other requests left in the drafters' history.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from fastapi.responses import StreamingResponse

from specdec_exact.server.errors import APIError, generation_failed
from specdec_exact.tools import ToolStream

if TYPE_CHECKING:
    from specdec_exact.logprobs import TokenLogprob
    from specdec_exact.metrics import SpecStats
    from specdec_exact.output import Chunk
    from specdec_exact.server.scheduler import Turn
    from specdec_exact.tools import ToolFormat
    from specdec_exact.vocabulary import TokenText

log = logging.getLogger("specdec.server.replies")


@dataclass
class Answer:
    """One choice's whole answer: its text, tokens, last chunk (finish reason, stats) and logprobs (where asked)."""
    text: str
    token_ids: list[int]
    last: Chunk
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Reply:
    """The response bodies of one request, in its endpoint's shape."""
    chat: bool
    model: str
    prompt_tokens: int
    with_token_ids: bool = False  # each choice carries the ids of its tokens (return_token_ids)
    with_stats: bool = False  # the last chunk, or the whole answer, carries `specdec` (return_speculation_stats)
    token_text: TokenText | None = None  # each token's text and bytes, where the request asks for logprobs
    tools: ToolFormat | None = None  # the format the answer's tool calls are read in (chat with tools)
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._offset = 0  # (completions) characters of the tokens' texts before the next token: its text_offset
        self._calls = ToolStream(self.tools) if self.tools is not None else None  # (a stream's text, held at a call)

    def logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """A choice's `logprobs` in its endpoint's shape for these tokens (None where they were not asked for)."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                return {"token": text.text(token), "logprob": logprob, "bytes": list(text.bytes(token))}

            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(*alt) for alt in lp.top]}
                                for lp in logprobs or []], "refusal": None}
        tokens = [text.text(lp.token) for lp in logprobs or []]
        offsets = []
        for piece in tokens:
            offsets.append(self._offset)
            self._offset += len(piece)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs or []],
                "top_logprobs": [None if lp.logprob is None else {text.text(t): logprob for t, logprob in lp.top}
                                 for lp in logprobs or []],
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def usage(self, stats: SpecStats) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": stats.new_tokens,
                "total_tokens": self.prompt_tokens + stats.new_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}

    def whole(self, answers: list[Answer], echo: tuple[str, list[TokenLogprob] | None] | None = None) -> dict:
        """The whole response: a choice per answer (n of them), usage over all. echo (completions): the prompt's text
        and its tokens' logprobs, put before each completion's (the logprobs None where they were not asked for)."""
        choices = [self._choice(i, answer, echo) for i, answer in enumerate(answers)]
        stats = answers[0].last.stats
        usage = self.usage(stats)
        usage["completion_tokens"] = sum(answer.last.stats.new_tokens for answer in answers)
        usage["total_tokens"] = self.prompt_tokens + usage["completion_tokens"]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage=usage,
                              **self._stats(stats))

    def _choice(self, index: int, answer: Answer, echo: tuple[str, list[TokenLogprob] | None] | None) -> dict:
        text, logprobs, finish = answer.text, answer.logprobs, answer.last.finish_reason
        self._offset = 0
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.tools is not None:
                message["content"], calls = self.tools.parse(text)
                if calls:
                    message["tool_calls"] = [call.as_openai() for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish}
        else:
            if echo is not None:
                text, logprobs = echo[0] + text, (echo[1] or []) + (logprobs or [])
            choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        if self.with_token_ids:
            choice["token_ids"] = answer.token_ids
        return choice

    def _stats(self, stats: SpecStats) -> dict:
        return {"specdec": stats.to_dict()} if self.with_stats else {}

    def piece(self, chunk: Chunk, first: bool, last: bool) -> dict:
        """A stream's chunk; the last one of text carries the stats, where asked for and no usage chunk follows."""
        if self.chat:
            text, finish, calls = chunk.text, chunk.finish_reason, []
            if self._calls is not None:  # text from a call's start on is held back, and read as calls at the end
                text = self._calls.feed(text)
                if finish is not None:
                    rest, calls = self._calls.finish()
                    text += rest
                    finish = "tool_calls" if calls and finish == "stop" else finish
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if calls:
                delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(calls)]
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(chunk.logprobs), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": self.logprobs(chunk.logprobs),
                      "finish_reason": chunk.finish_reason}
        if self.with_token_ids:
            choice["token_ids"] = chunk.token_ids
        extra = self._stats(chunk.stats) if last else {}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_piece(self, stats: SpecStats) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=self.usage(stats), **self._stats(stats))


def event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def events(turn: Turn, first: Chunk, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """One event per generator Chunk, the usage chunk if asked for, then [DONE]. An error mid-stream (the status line
    is already sent: the request failed or timed out) becomes an error event, as OpenAI sends it, and ends the
    stream without [DONE]."""
    chunk, is_first = first, True
    try:
        while chunk is not None:
            last = chunk.finish_reason is not None
            yield event(reply.piece(chunk, is_first, last=last and not include_usage))
            if last:
                if include_usage:
                    yield event(reply.usage_piece(chunk.stats))
                break
            chunk, is_first = await turn.next(), False
    except APIError as error:
        yield event(error.body())
        return
    except Exception as error:
        log.exception("a streamed response failed")
        yield event(generation_failed(error).body())
        return
    yield "data: [DONE]\n\n"


class TurnStream(StreamingResponse):
    """Server-sent events that free the model when the response ends, however it ends: finished, client gone (the body
    cancelled mid-cycle or left waiting at a yield), or never started."""

    def __init__(self, body: AsyncIterator[str], turn: Turn):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.turn = turn

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.turn.close()
