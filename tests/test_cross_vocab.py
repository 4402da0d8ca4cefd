"""Drafting across vocabularies (specdec_exact.drafters.cross_vocab): tiny models with two different byte-level BPE
tokenizers over the same alphabet. The sequence-distribution test of the sampling method is in test_statistical.py."""

from __future__ import annotations

import pytest
import torch

from specdec_exact import SpeculativeGenerator
from specdec_exact.drafters import CrossVocabDrafter
from specdec_exact.drafters.cross_vocab import DraftText, Vocabularies
from specdec_exact.vocabulary import IncompatibleVocabulary
from specdec_exact.sampling import SamplingConfig, make_generator

from conftest import (ALPHABET, DRAFT_MERGES, TARGET_MERGES, byte_bpe_tokenizer, char_tokenizer, successor_model,
                      tiny_model)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["abc", "hgfe dcba", "a b c d e f g h", "ééé abcd", "dd\nee\nff", "habcdefg", "gg", "cafe bead", "e",
           "fed cab\n\nabcdefgh", "bad egg", "aaaa hhhh"]


@pytest.fixture(scope="module")
def tokenizers():
    # The draft also knows U+FFFD (as real tokenizers do), so a character decoded before its last byte arrived shows.
    return byte_bpe_tokenizer(ALPHABET, TARGET_MERGES), byte_bpe_tokenizer(ALPHABET[::-1] + "\ufffd", DRAFT_MERGES)


@pytest.fixture(scope="module")
def vocab(tokenizers):
    target, draft = tokenizers
    return Vocabularies(target, len(target), draft, len(draft))


def test_tokens_are_matched_by_their_bytes(tokenizers, vocab):
    target, draft = tokenizers
    target_vocab = target.get_vocab()
    for token, draft_id in draft.get_vocab().items():
        mapped = int(vocab.draft_to_target[draft_id])
        assert (mapped >= 0) == (token in target_vocab)
        if mapped >= 0:
            assert target.convert_ids_to_tokens(mapped) == token
    assert int(vocab.draft_to_target[draft.eos_token_id]) == target.eos_token_id  # special tokens by their text
    assert vocab.draft_bytes[draft.convert_tokens_to_ids("h ".replace(" ", "\u0120"))] == b"h "
    assert {vocab.target_bytes[i] for i in target("é", add_special_tokens=False).input_ids} == {b"\xc3", b"\xa9"}
    assert int(vocab.shared.sum()) == len(ALPHABET.encode()) + 1  # the single bytes and <eos>; no merged token


def test_a_tokenizer_that_is_not_byte_level_is_refused_with_both_reasons(tokenizers):
    target = tiny_model("llama", seed=0, vocab_size=len(tokenizers[0]))
    draft = tiny_model("llama", seed=1, vocab_size=len(char_tokenizer()))
    with pytest.raises(IncompatibleVocabulary, match="tokenizers differ .* first difference at id 0.*byte-level BPE"):
        SpeculativeGenerator(target, draft, tokenizer=tokenizers[0], draft_tokenizer=char_tokenizer())


def test_draft_text_keeps_in_step_with_the_committed_tokens(tokenizers, vocab):
    """Fed the target's tokens a few at a time (a two-byte character split between updates among them), the draft's
    tokens are those of its tokenizer for the whole text, up to the last complete character."""
    target, draft = tokenizers
    text = "abcdefgh é abcd\nhgfedcba ébé " * 3
    ids = target(text, add_special_tokens=False).input_ids
    split = next(i for i, t in enumerate(ids) if vocab.target_bytes[t] == b"\xc3") + 1  # inside the "é"
    synced = DraftText(vocab)
    for end in [3, split, split + 1, *range(split + 5, len(ids), 7), len(ids)]:
        got = synced.update(torch.tensor([ids[:end]]))[0].tolist()
        complete = bytes(synced.text).decode("utf-8", errors="ignore") if end != split else target.decode(
            ids[: split - 1])
        assert got == draft(complete, add_special_tokens=False).input_ids, end


def greedy_pair(tokenizers, draft_model=None):
    target_tokenizer, draft_tokenizer = tokenizers
    target = tiny_model("llama", seed=0, vocab_size=len(target_tokenizer))
    draft = draft_model if draft_model is not None else tiny_model("qwen2", seed=3, vocab_size=len(draft_tokenizer))
    return target, draft


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_output_is_the_targets_on_many_prompts(tokenizers, k):
    target_tokenizer, draft_tokenizer = tokenizers
    target, draft = greedy_pair(tokenizers)
    gen = SpeculativeGenerator(target, draft, k=k, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    plain = SpeculativeGenerator(target, None, tokenizer=target_tokenizer)
    assert isinstance(gen.drafter, CrossVocabDrafter) and "re-tokenized" in gen.cross_vocabulary
    drafted = 0
    for prompt in PROMPTS:
        out, want = gen.generate(prompt, max_new_tokens=24), plain.generate(prompt, max_new_tokens=24)
        assert out.token_ids == want.token_ids, prompt
        drafted += out.stats.drafted_tokens
        counts = out.stats.drafter_counts
        assert counts["cross_vocab_draft_tokens"] == out.stats.draft_calls
    assert drafted > 0


def text_cycle_models(tokenizers, cycle: str = "abcdefgh"):
    """Target and draft whose greedy text runs around `cycle` (distinct characters) forever, each in its own
    tokens: after a token, each predicts the first token of its own tokenization of the text that follows."""
    models = []
    for tokenizer in tokenizers:
        vocab = tokenizer.get_vocab()
        following = {}
        for token, i in vocab.items():
            text = tokenizer.convert_tokens_to_string([token])
            at = cycle.find(text[-1:]) if text and text in cycle * 2 else -1
            rest = (cycle * 3)[at + 1:] if at >= 0 else cycle * 2
            following[i] = tokenizer(rest, add_special_tokens=False).input_ids[0]
        models.append(successor_model(following, len(tokenizer)))
    return models


def test_a_draft_that_writes_the_targets_text_in_other_tokens_is_accepted(tokenizers, trusted_torch_widths):
    """The re-tokenization works: a draft whose text is the target's, cut into other tokens, gets its first tokens
    accepted (a broken boundary or mapping would have them rejected). The last one of a cycle is often a piece of a
    longer target token (the draft stopped inside it: "a" for "abcd"), which the target rejects."""
    target_tokenizer, draft_tokenizer = tokenizers
    target, draft = text_cycle_models(tokenizers)
    gen = SpeculativeGenerator(target, draft, k=4, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    plain = SpeculativeGenerator(target, None, tokenizer=target_tokenizer)
    out = gen.generate("abcd", max_new_tokens=60)
    assert out.token_ids == plain.generate("abcd", max_new_tokens=60).token_ids
    assert out.text.startswith("efghabcdefgh")
    assert min(out.stats.acceptance_by_position[:2]) > 0.9, out.stats.to_dict()
    counts = out.stats.drafter_counts
    assert counts["cross_vocab_target_tokens"] != counts["cross_vocab_draft_tokens"]  # the texts were re-cut


def test_sampled_proposals_are_a_distribution_over_shared_target_tokens(tokenizers, vocab):
    target, draft = greedy_pair(tokenizers)
    drafter = SpeculativeGenerator(target, draft, k=3, tokenizer=tokenizers[0],
                                   draft_tokenizer=tokenizers[1]).drafter
    context = tokenizers[0]("abcd ef", return_tensors="pt", add_special_tokens=False).input_ids
    drafter.begin(context)
    proposal = drafter.propose(context, 3, SamplingConfig(temperature=1.0), make_generator(0))
    q = proposal.probs  # [1, 3, target vocab]
    assert q.shape == (1, 3, len(tokenizers[0]))
    assert torch.allclose(q.sum(-1), torch.ones(1, 3, dtype=q.dtype))
    outside = torch.ones(len(tokenizers[0]), dtype=torch.bool)
    outside[vocab.draft_to_target[vocab.shared]] = False
    assert (q[..., outside] == 0).all() and outside.any()
    assert all(q[0, i, t] > 0 for i, t in enumerate(proposal.tokens[0].tolist()))
    assert 0 < proposal.counts["cross_vocab_outside_mass"] < 3


def test_batched_and_seeded_cross_vocabulary_requests_match_their_solo_runs(tokenizers):
    target, draft = greedy_pair(tokenizers)
    gen = SpeculativeGenerator(target, draft, k=2, tokenizer=tokenizers[0], draft_tokenizer=tokenizers[1])
    prompts = PROMPTS[:5]
    for temperature in (0.0, 0.9):
        batch = gen.generate_many(prompts, max_new_tokens=16, temperature=temperature, seed=5)
        for i, prompt in enumerate(prompts):
            alone = gen.generate(prompt, max_new_tokens=16, temperature=temperature, seed=5 + i)
            assert batch[i].token_ids == alone.token_ids, (temperature, prompt)


def test_the_choice_reads_a_long_prompt_in_the_drafts_own_tokens_a_pass_per_cycle(tokenizers, vocab):
    """Under the per-cycle choice (llama.cpp's "auto"), a draft with another vocabulary reads the prompt pass by pass
    in its own tokens (never the target's ids), and the output stays the target's."""
    from conftest import reference_greedy
    from specdec_exact.adaptive import FixedK
    from specdec_exact.drafters import SuffixDrafter
    from specdec_exact.drafters.choice import ChoosingDrafter, Costs
    from specdec_exact.engine import speculative_decode
    from specdec_exact.runtimes.pytorch import TorchRunner
    from test_drafters import PassByPassRunner

    target_tokenizer, draft_tokenizer = tokenizers
    target, draft = greedy_pair(tokenizers)
    runners = []

    def make_runner():
        runners.append(PassByPassRunner(draft, draft.config.vocab_size))
        return runners[-1]

    free = Costs(lambda width: 1.0 + 0.02 * (width - 1), draft_step=0.2, draft_token=0.0)
    drafter = ChoosingDrafter(SuffixDrafter(), CrossVocabDrafter(make_runner, vocab), free)
    drafter.others_waiting = True  # (as in a batch of several)
    prompt = target_tokenizer(" ".join(PROMPTS), add_special_tokens=False).input_ids
    steps = speculative_decode(TorchRunner(target, target.config.vocab_size), drafter, torch.tensor([prompt]),
                               k=FixedK(4), max_new_tokens=24, sampling=SamplingConfig(), generator=make_generator(0))
    got = [t for step in steps for t in step.tokens]
    assert got == reference_greedy(target, prompt, 24)
    read = draft_tokenizer(target_tokenizer.decode(prompt), add_special_tokens=False).input_ids
    assert len(read) > 3 * PassByPassRunner.PIECE and runners[-1].fed[:3] == [PassByPassRunner.PIECE] * 3
    assert runners[-1].seen[:3 * PassByPassRunner.PIECE] == read[:3 * PassByPassRunner.PIECE]  # its own tokens
