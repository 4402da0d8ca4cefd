"""The methods a benchmark compares, every one on the same loaded target and draft model (shared, never copied).

ours:          target-only (no drafter: the baseline), the draft model at a fixed k or k="auto", and each drafter in
               specdec_exact.drafters.DRAFTERS (ngram, hybrid, self:N, ...), through the same
               SpeculativeGenerator users run
transformers:  assisted generation with the draft model, prompt lookup, and plain `generate` as a sanity baseline
               (torch runtime)
llama-cpp-python: its own generation loop and its own prompt-lookup speculation on the same GGUF file (llama.cpp
               runtime)
llama-server:  upstream llama-server on the same GGUF file, over HTTP (llama.cpp runtime; `make llama-server`)

A method is written NAME[@K]: "target-only", "draft@4", "draft@auto", "ngram@4", "self:7@4", "hf-assisted",
"llama-lookup", or "model:MODEL@K" for a draft model other than the run's own (--draft), given like --target (e.g.
"model:smollm2-135m-instruct@3": a draft with its own vocabulary, see drafters.cross_vocab). A peer that does not run
on the benchmark's runtime is skipped with the reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specdec_exact import adaptive
from specdec_exact.drafters import DRAFTERS, ModelDrafter
from specdec_exact.generator import SpeculativeGenerator
from specdec_exact.metrics import SpecStats
from specdec_exact.runtimes import RUNTIMES


class MethodUnavailable(Exception):
    """A method that cannot run in this build or with these models; the benchmark skips it and says why."""


@dataclass
class Output:
    token_ids: list[int]  # new tokens only, cut before the first end-of-sequence token
    stats: SpecStats | None = None  # ours only: the engine's own counts and timings


class Method:
    label: str  # in the report, e.g. "draft@4", "self:7@4"
    spec: str = ""  # as written in the preset or on the command line, e.g. "self@4"
    family: str  # "ours" or "transformers"
    k: int | str | None = None  # draft tokens per cycle (ours with a drafter)
    uses_draft_model: bool = False  # drafts with the draft model, so the cost-based prediction applies
    out_of_process: bool = False  # runs in a worker process (its CPU time is not this process's)

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int | None) -> Output:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"spec": self.spec, "family": self.family, "k": self.k, "uses_draft_model": self.uses_draft_model}

    def close(self) -> None:
        """Release what the method holds beyond the shared models (a worker process)."""


class Ours(Method):
    family = "ours"

    def __init__(self, label: str, generator: SpeculativeGenerator, k: int | str | None, uses_draft_model: bool,
                 draft_model: str | None = None):
        """draft_model: the name of a model:MODEL method's own draft (None: the run's draft model, if any)."""
        self.label, self.generator, self.k, self.uses_draft_model = label, generator, k, uses_draft_model
        self.draft_model = draft_model

    def describe(self) -> dict:
        return {**super().describe(), "draft_model": self.draft_model,
                "cross_vocabulary": self.generator.cross_vocabulary}

    def run(self, prompt_ids, max_new_tokens, temperature, seed) -> Output:
        out = self.generator.generate(prompt_ids, max_new_tokens, temperature, seed=seed, k=self.k)
        return Output(out.token_ids, out.stats)


class Transformers(Method):
    """`target.generate(...)`, greedy or sampled like ours (no top-k / top-p), with our end-of-sequence ids."""

    family = "transformers"

    def __init__(self, label: str, target, eos_ids: frozenset[int], **generate_kwargs):
        self.label, self.target, self.generate_kwargs = label, target, generate_kwargs
        self.eos_ids = sorted(eos_ids)
        self.assistant = generate_kwargs.get("assistant_model")

    def run(self, prompt_ids, max_new_tokens, temperature, seed) -> Output:
        if temperature > 0:
            torch.manual_seed(seed)  # transformers samples from the global generator
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)  # top_k=0: off (default 50)
        else:
            sampling = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        eos = dict(eos_token_id=self.eos_ids or None, pad_token_id=self.eos_ids[0] if self.eos_ids else None)
        # Assisted generation writes its tuned schedule back into the assistant's generation_config; restoring it
        # keeps every prompt's run independent of the previous one.
        saved = copy.deepcopy(self.assistant.generation_config) if self.assistant is not None else None
        try:
            with torch.inference_mode():
                sequences = self.target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                                 max_new_tokens=max_new_tokens, **sampling, **eos,
                                                 **self.generate_kwargs)
        finally:
            if saved is not None:
                self.assistant.generation_config = saved
        new = sequences[0, prompt_ids.shape[1]:].tolist()
        end = next((i for i, token in enumerate(new) if token in self.eos_ids), len(new))
        return Output(new[:end])


class LlamaCppPython(Method):
    """llama-cpp-python's own `Llama.generate` loop, greedy, optionally with its prompt-lookup speculation.

    It loads the same GGUF file again (memory-mapped, so the weights are shared through the page cache) in a worker
    process of its own (runtimes.llamacpp.peer: a crash there cannot take the benchmark down), with llama.cpp's default
    context settings: what a user of llama.cpp runs.
    """

    family = "llama-cpp-python"
    out_of_process = True

    def __init__(self, label: str, model, eos_ids: frozenset[int], lookup_tokens: int | None = None):
        from specdec_exact.runtimes.llamacpp.peer import LlamaCppPythonPeer, plain_settings

        self.label, self.eos_ids, self.lookup_tokens = label, eos_ids, lookup_tokens
        self.peer = LlamaCppPythonPeer(str(model.path), plain_settings(model), lookup_tokens)

    def run(self, prompt_ids, max_new_tokens, temperature, seed) -> Output:
        if temperature > 0:
            raise ValueError("the llama-cpp-python peers run greedy only")
        return Output(self.peer.generate(prompt_ids[0].tolist(), max_new_tokens, self.eos_ids))

    def describe(self) -> dict:
        return {**super().describe(), "loaded_as": self.peer.loaded_as}

    def close(self) -> None:
        self.peer.close()


class LlamaServer(Method):
    """Upstream llama-server (built by `make llama-server` without specdec's patch, its defaults, or --no-repack where
    those crash) on the target's GGUF file, a subprocess on a loopback port: each prompt goes to its /completion
    endpoint as token ids, greedy, and the token ids of the answer come back. What users of llama.cpp run as a
    server."""

    family = "llama-server"
    out_of_process = True

    def __init__(self, label: str, model, eos_ids: frozenset[int]):
        import contextlib
        import tempfile
        from pathlib import Path

        from specdec_exact.llama_server import ServerProcess, default_llama_server, llama_server

        try:
            binary = default_llama_server()
        except FileNotFoundError as error:
            raise MethodUnavailable(str(error)) from None
        if not binary.is_file():
            raise MethodUnavailable(f"llama-server is not built: run `make llama-server` (expected {binary})")
        self.label, self.eos_ids = label, eos_ids
        self._stack = contextlib.ExitStack()
        scratch = Path(self._stack.enter_context(tempfile.TemporaryDirectory()))
        self.process = self._stack.enter_context(ServerProcess(llama_server(label, binary, str(model.path),
                                                                            model.threads),
                                                               scratch / "llama-server.log"))

    def run(self, prompt_ids, max_new_tokens, temperature, seed) -> Output:
        import httpx

        if temperature > 0:
            raise ValueError("the llama-server peer runs greedy only")
        reply = httpx.post(f"{self.process.url}/completion", timeout=1800, json={
            "prompt": prompt_ids[0].tolist(), "n_predict": max_new_tokens, "temperature": 0, "return_tokens": True})
        reply.raise_for_status()
        new = reply.json()["tokens"]
        end = next((i for i, token in enumerate(new) if token in self.eos_ids), len(new))
        return Output(new[:end])

    def describe(self) -> dict:
        return {**super().describe(), "command": self.process.argv}

    def close(self) -> None:
        self._stack.close()


PEERS = tuple(peer for runtime in RUNTIMES.values() for peer in runtime.peers)
LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens, the value transformers' docs suggest


def build_methods(specs, gen: SpeculativeGenerator, default_k: int | str = 4) -> tuple[list[Method], dict[str, str]]:
    """-> (methods in the given order, {spec: why it was skipped}). Models come from gen and are shared."""
    methods, skipped = [], {}
    for spec in dict.fromkeys(specs):
        try:
            method = build_method(spec, gen, default_k)
        except MethodUnavailable as reason:
            skipped[spec] = str(reason)
            continue
        method.spec = spec
        methods.append(method)
    return methods, skipped


def build_method(spec: str, gen: SpeculativeGenerator, default_k: int | str = 4) -> Method:
    name, _, k_text = spec.partition("@")
    if name == "target-only":
        return Ours(spec, _sibling(gen, None), None, False)
    if name in PEERS:
        return _peer(name, gen)
    k = _parse_k(k_text or str(default_k))
    if name == "draft":
        if gen.draft is None and gen.drafter.name == "none":
            raise MethodUnavailable("no draft given (--draft none)")
        # draft@auto is gen's own drafter (with a draft model: the per-cycle choice); draft@K the draft model alone.
        drafter = gen.drafter if k == "auto" else _alone(gen.drafter)
        return Ours(f"draft@{k}", _sibling(gen, drafter, k), k, gen.draft is not None)
    drafter_name, _, arg = name.partition(":")
    if drafter_name == "model":
        try:
            other = _sibling(gen, arg, k)
        except (ValueError, OSError) as error:
            raise MethodUnavailable(f"draft model {arg!r}: {error}") from None
        # As draft@K: at a fixed k the draft model alone, at auto the per-cycle choice.
        if k != "auto":
            other.drafter = _alone(other.drafter)
        return Ours(f"{name}@{k}", other, k, True, draft_model=arg)
    if drafter_name not in DRAFTERS:
        raise MethodUnavailable(f"no drafter {drafter_name!r} in specdec_exact.drafters.DRAFTERS "
                                f"(registered: {', '.join(sorted(DRAFTERS))})")
    try:
        drafter = _shared_hybrid(gen) if drafter_name == "hybrid" and not arg else name
        other = _sibling(gen, drafter)
    except ValueError as error:
        raise MethodUnavailable(str(error)) from None
    # Without an argument the drafter's own name says what the default became: "self" -> "self:7".
    return Ours(f"{name if arg else other.drafter.name}@{k}", other, k, False)


def _parse_k(text: str) -> int | str:
    try:
        adaptive.make_k_policy(text)
    except (NameError, AttributeError):  # k="auto" named before its policy exists in this build
        raise MethodUnavailable(f"k={text!r} is not available in this build") from None
    return text if text == "auto" else int(text)


def _sibling(gen: SpeculativeGenerator, drafter, k: int | str = "auto") -> SpeculativeGenerator:
    """Another generator on gen's loaded target (shared, never copied) and runtime; like gen (the benchmark's), it
    caches no prompts: every method prefills every prompt."""
    return SpeculativeGenerator(gen.target, drafter, k, tokenizer=gen.tokenizer, runtime=gen.runtime, prompt_cache=0)


def _peer(name: str, gen: SpeculativeGenerator) -> Method:
    if name not in gen.runtime.peers:
        home = next(runtime for runtime in RUNTIMES.values() if name in runtime.peers)
        raise MethodUnavailable(f"{name} ({home.peers[name]}) runs on the {home.name} runtime (--runtime {home.name})")
    if name == "llama-server":
        return LlamaServer(name, gen.target, gen.eos_ids)
    if name.startswith("llama-"):
        return LlamaCppPython(name, gen.target, gen.eos_ids, LOOKUP_TOKENS if name == "llama-lookup" else None)
    if name == "hf-generate":
        return Transformers(name, gen.target, gen.eos_ids)
    if name == "hf-lookup":
        return Transformers(name, gen.target, gen.eos_ids, prompt_lookup_num_tokens=LOOKUP_TOKENS)
    if gen.draft is None:
        raise MethodUnavailable("assisted generation needs a draft model (--draft is not a model)")
    return Transformers(name, gen.target, gen.eos_ids, assistant_model=gen.draft)


def _alone(drafter):
    """The draft model's own drafter where `drafter` chooses among options per cycle (k="auto"), else drafter."""
    return getattr(drafter, "model_drafter", None) or drafter


def _shared_hybrid(gen: SpeculativeGenerator):
    """Prompt lookup, else gen's own model drafter (the registered "hybrid" factory would load a second draft model;
    rebuilding one here would lose a draft tokenizer of its own)."""
    from specdec_exact.drafters.hybrid import HybridDrafter
    from specdec_exact.drafters.ngram import NgramDrafter

    model = _alone(gen.drafter)
    if gen.draft is None or not isinstance(model, ModelDrafter):
        raise MethodUnavailable("hybrid needs a draft model to fall back on (--draft is not a model)")
    return HybridDrafter(NgramDrafter(), model)
