"""A generation request: everything that decides its output, checked once, frozen.

SpeculativeGenerator.request builds one from what a caller gives (text, token ids or chat messages, and the
sampling settings) and checks it against the context a sequence holds; generate(), generate_many() and the server
all decode Request objects, so a prompt takes one path and its length is checked in one place with one meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_exact.adjust import LogitAdjust
from specdec_exact.grammar import Grammar
from specdec_exact.logprobs import check_top
from specdec_exact.sampling import SamplingConfig


class ContextLengthExceeded(ValueError):
    """The prompt and the tokens asked for do not fit in the context one sequence holds."""

    def __init__(self, n_prompt: int, max_new_tokens: int, limit: int):
        self.n_prompt, self.max_new_tokens, self.limit = n_prompt, max_new_tokens, limit
        if n_prompt >= limit:
            message = (f"the prompt has {n_prompt} tokens, but the context holds {limit} tokens, prompt and "
                       "completion together: shorten the prompt")
        else:
            message = (f"the context holds {limit} tokens, but {n_prompt + max_new_tokens} were requested "
                       f"({n_prompt} in the prompt, {max_new_tokens} for the completion): shorten the prompt or "
                       f"ask for at most {limit - n_prompt} new tokens")
        super().__init__(message)

    @property
    def prompt_too_long(self) -> bool:
        return self.n_prompt >= self.limit


@dataclass(frozen=True, eq=False)
class Request:
    """One request (eq=False: two equal requests are still two requests)."""

    prompt_ids: tuple[int, ...]  # the prompt's token ids, chat template applied
    max_new_tokens: int  # the most tokens to generate (0: none, and nothing is evaluated)
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None  # a sample's random stream; None: fresh randomness
    stop: tuple[str, ...] = ()  # output ends before the first of these strings
    k: int | str = "auto"  # draft tokens per cycle, or "auto"
    # Whose earlier requests this one may draw on (the prompt cache's segments and answers, the suffix lookup's
    # history): those of the same tenant only; None, the one tenant of a server without keys or that shares them.
    tenant: str | None = None
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    adjust: LogitAdjust | None = None  # a logit bias and penalties on the target's logits (specdec_exact.adjust)
    grammar: Grammar | None = None  # what the output must follow (specdec_exact.grammar: a JSON schema, a regex, ...)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        check_top(self.logprobs)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @property
    def seeded_sample(self) -> bool:
        """A sample that must repeat for its seed: what it drafts decides how its random stream is used, so it may
        depend on nothing but itself (not on what other requests left in a shared drafting history)."""
        return self.seed is not None and not self.sampling.greedy

    def check_fits(self, limit: int) -> None:
        """Refuse a request whose prompt and max_new_tokens together exceed `limit` tokens."""
        if len(self.prompt_ids) + self.max_new_tokens > limit or len(self.prompt_ids) >= limit:
            raise ContextLengthExceeded(len(self.prompt_ids), self.max_new_tokens, limit)
