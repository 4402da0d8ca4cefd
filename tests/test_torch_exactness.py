"""The torch runtime's exact verify width (runtimes.pytorch.exact_verify_width): passes up to the calibrated width
reproduce one-token logits bit for bit, on tiny float32 models and on the real 0.5B; a model whose wide passes are one
ulp off calibrates narrower; and speculative greedy output of the real model equals plain one-token decoding.

Each check here runs the model through transformers directly, with caches of its own, so that it does not share the
calibration's code (runtimes.pytorch.exact_pass_widths)."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from transformers.cache_utils import DynamicCache

from specdec_exact.models import quantize_int8
from specdec_exact.runtimes import TORCH
from specdec_exact.runtimes.pytorch import CALIBRATION_WIDTHS, ExactWidth, TorchRunner, exact_verify_width

from conftest import require, tiny_model

VOCAB = 64
WIDEST = max(CALIBRATION_WIDTHS)


def random_tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, n]


def forward(model, cache: DynamicCache, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0).logits[0]


@torch.inference_mode()
def exact_widths(model, prompt: torch.Tensor, continuation: torch.Tensor, widths) -> list[int]:
    """The widths w in widths for which one pass over continuation[:, :w] after prompt [1, n] gives the logits that
    w one-token passes after the same prompt give, bit for bit. Each side prefills the prompt in a cache of its own;
    the wide passes start from the prefilled cache each time (cropped back to the prompt)."""
    one_token, together = DynamicCache(config=model.config), DynamicCache(config=model.config)
    forward(model, one_token, prompt, last_only=True)
    forward(model, together, prompt, last_only=True)
    alone = torch.cat([forward(model, one_token, continuation[:, i:i + 1]) for i in range(max(widths))])
    exact = []
    for width in widths:
        if torch.equal(forward(model, together, continuation[:, :width]), alone[:width]):  # [width, vocab] each
            exact.append(width)
        together.crop(-width)
    return exact


def tiny_float32(arch: str, max_positions: int = 256):
    return tiny_model(arch, seed=0, vocab_size=VOCAB, max_positions=max_positions).float()


def tiny_int8(arch: str, max_positions: int = 256):
    """specdec's int8 (rows independent in every layer and in attention): exact at every width by construction."""
    return quantize_int8(tiny_float32(arch, max_positions))


def one_ulp_off(model, when):
    """model, its logits moved up by one ulp in every pass over width tokens after `cached` ones where
    when(width, cached): a kernel that rounds a wide pass differently, as fp32 matrix products do."""
    original = model.forward

    def forward(input_ids=None, cache=None, **kwargs):
        out = original(input_ids=input_ids, cache=cache, **kwargs)
        width = input_ids.shape[1]
        if when(width, cache.get_seq_length() - width):
            out.logits = torch.nextafter(out.logits, torch.tensor(math.inf))
        return out

    model.forward = forward
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("make", [tiny_float32, tiny_int8], ids=["float32", "int8"])
def test_calibrated_width_reproduces_one_token_logits_at_every_width_up_to_it(one_thread, make, arch):
    """At contexts probed and between them (100 tokens), on prompts other than the calibration's: every width up to
    the calibrated one is exact; the next one, where the calibration stopped short of 16, is not (so the calibration
    is not merely cautious); specdec's int8 is exact at every width checked."""
    model = make(arch)
    found = exact_verify_width(model)
    lengths = (16, 100, 256 - WIDEST)  # the last: as far as a tiny model's context lets a pass of 16 tokens reach
    beyond = []  # whether the width after the calibrated one is exact, at each length
    for length in lengths:
        prompt, continuation = random_tokens(length, VOCAB, length), random_tokens(WIDEST, VOCAB, length + 1)
        widths = range(2, min(found.width + 1, WIDEST) + 1)
        exact = exact_widths(model, prompt, continuation, widths)
        assert [w for w in widths if w <= found.width] == [w for w in exact if w <= found.width], length
        beyond.append(found.width + 1 in exact)
    if found.width < WIDEST:
        assert not all(beyond)
    if make is tiny_int8:
        assert found == ExactWidth(WIDEST, 256 - WIDEST)  # the whole context is checked


@pytest.mark.parametrize("when, expected", [
    (lambda width, cached: width > 1, 1),
    (lambda width, cached: width >= 5, 4),
    (lambda width, cached: width > 1 and cached >= 500, 1),  # only the long context's passes: the 600-token probe
], ids=["every-wide-pass", "from-width-5", "past-500-cached"])
def test_a_model_whose_wide_passes_are_one_ulp_off_calibrates_narrower(one_thread, when, expected):
    """The negative control: the same int8 model, exact at every width unperturbed, with the logits of some wide
    passes one ulp off. The calibration must find the first perturbed width at whichever context it shows, and the
    positive check above must fail one width beyond what it finds."""
    model = one_ulp_off(tiny_int8("llama", max_positions=700), when)
    found = exact_verify_width(model)
    assert found.width == expected
    assert expected + 1 not in exact_widths(model, random_tokens(600, VOCAB, 1), random_tokens(expected + 1, VOCAB, 2),
                                            [expected + 1])


def test_calibrated_once_per_model_and_settings_and_nothing_promised_beyond_the_longest_context(one_thread):
    """prepare_as_target measures; the runners' verify_width reads what it found; a change of what kernels choose by
    (here the attention implementation) measures again. Past the longest context checked, one token at a time."""
    passes = []
    model = one_ulp_off(tiny_int8("qwen2", max_positions=64), lambda width, cached: passes.append(width) and False)
    TORCH.prepare_as_target(model)
    measured = len(passes)
    assert measured > 0
    runner = TorchRunner(model, VOCAB)
    assert exact_verify_width(model) == ExactWidth(WIDEST, 64 - WIDEST)
    assert runner.verify_width(0) == runner.verify_width(64 - WIDEST) == WIDEST
    assert runner.verify_width(64 - WIDEST + 1) == 1
    assert len(passes) == measured  # nothing measured again
    model.set_attn_implementation("sdpa")
    exact_verify_width(model)
    assert len(passes) > measured


REAL_MODEL = "qwen2.5-coder-0.5b-instruct"
# A real prompt: code, long enough that the passes checked come after more cached tokens than the shortest probe.
PROMPT = '''import math


def weighted_median(values, weights):
    """Return the value at which the cumulative weight first reaches half of the total weight.

    values and weights are sequences of the same length; weights are non-negative and not all zero.
    >>> weighted_median([1, 2, 3], [1, 1, 1])
    2
    >>> weighted_median([1, 2, 3, 4], [3, 1, 1, 1])
    1
    """
'''


def load_real(dtype=torch.float32, quantization=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_exact import registry

    require(registry.is_cached(REAL_MODEL), f"model not pulled: run `specdec-exact models pull {REAL_MODEL}`")
    directory = registry.local_model_dir(REAL_MODEL)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True).eval()
    if quantization is not None:
        quantization(model)
    return model, AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def real_fp32():
    model, tokenizer = load_real()
    yield model, tokenizer
    del model
    gc.collect()


@pytest.fixture(scope="module")
def real_int8():
    model, tokenizer = load_real(quantization=quantize_int8)
    yield model, tokenizer
    del model
    gc.collect()


@torch.inference_mode()
def plain_greedy(model, prompt_ids: list[int], n: int, vocab: int, eos: frozenset[int]) -> list[int]:
    """Plain decoding: the prompt prefilled in one pass, then one token per pass, each the argmax of its logits over
    the first vocab tokens; stops before an end-of-sequence token, as the generator does."""
    cache = DynamicCache(config=model.config)
    logits = forward(model, cache, torch.tensor([prompt_ids]), last_only=True)[-1, :vocab]
    tokens = []
    for _ in range(n):
        token = int(logits.argmax())
        if token in eos:
            break
        tokens.append(token)
        logits = forward(model, cache, torch.tensor([[token]]))[-1, :vocab]
    return tokens


def check_real_calibration(model, tokenizer) -> int:
    """The calibrated width's passes reproduce one-token logits on a real prompt; the next width does not."""
    found = exact_verify_width(model)
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    continuation = torch.tensor([tokenizer(" " * 4 + "total = sum(weights)\n    running = 0.0\n")["input_ids"]])
    continuation = torch.cat([continuation] * WIDEST, dim=1)[:, :WIDEST]
    widths = range(2, min(found.width + 1, WIDEST) + 1)
    exact = exact_widths(model, prompt, continuation, widths)
    assert [w for w in widths if w <= found.width] == [w for w in exact if w <= found.width]
    assert found.width + 1 not in exact  # where the calibration stopped short of 16, it was not merely cautious
    return found.width


def check_real_greedy(target, draft, tokenizer):
    from specdec_exact import SpeculativeGenerator

    gen = SpeculativeGenerator(target, draft, k=4, tokenizer=tokenizer, draft_tokenizer=tokenizer, runtime="torch")
    ids = tokenizer(PROMPT)["input_ids"]
    out = gen.generate(ids, max_new_tokens=48)
    assert out.token_ids == plain_greedy(target, ids, 48, gen.vocab_size, gen.eos_ids)
    return out


@pytest.mark.real_model
def test_real_fp32_calibrated_width_reproduces_one_token_logits(real_fp32):
    check_real_calibration(*real_fp32)


@pytest.mark.real_model
def test_real_fp32_speculative_greedy_equals_plain_one_token_decoding(real_fp32):
    """The 0.5B as its own draft: every draft token is accepted, so each verify pass is as wide as the calibrated
    width lets it be."""
    model, tokenizer = real_fp32
    check_real_greedy(model, model, tokenizer)


@pytest.mark.real_model
def test_real_int8_is_exact_at_every_width_and_speculative_greedy_equals_plain(real_int8, real_fp32):
    """specdec's int8 0.5B as the target, the fp32 0.5B as its draft: a close draft that is sometimes rejected, over
    verify passes as wide as 5 tokens."""
    model, tokenizer = real_int8
    assert check_real_calibration(model, tokenizer) == WIDEST
    out = check_real_greedy(model, real_fp32[0], tokenizer)
    assert out.stats.drafted_tokens > 0
