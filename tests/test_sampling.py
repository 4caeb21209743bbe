"""The generation loop's request options: stop strings (streamed without ever showing text past one), n choices
from one prefill, log-probabilities from the logits each mode sampled from, and presence/frequency penalties."""
from __future__ import annotations

import pytest
import torch

import pop_vlm.generate
from pop_vlm import PopConfig, SamplingParams
from pop_vlm.sampling import apply_penalties, sample_token
from pop_vlm.textstream import DecodedText, held_back

from .conftest import QUESTION, image_for


def greedy(pipe, picture, tokens=16, **kwargs):
    return pipe.answer(image_for(pipe, picture), QUESTION, max_new_tokens=tokens, **kwargs)


def token_boundaries(pipe, token_ids) -> list[int]:
    """Character offsets in the decoded text where each token (after the first) begins."""
    return [len(pipe.decode(token_ids[:i])) for i in range(1, len(token_ids))]


def split_stop(pipe, answer, before: int = 2, after: int = 2) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next, and where it begins in the text."""
    text = answer.text
    for b in token_boundaries(pipe, answer.token_ids)[1:]:
        candidate = text[b - before:b + after]
        if len(candidate) == before + after and "\ufffd" not in candidate and text.find(candidate) == b - before:
            return candidate, b - before
    pytest.skip("no token boundary with plain characters on both sides in this output")


# ---- stop strings -------------------------------------------------------------------------------------------------
def test_held_back_suffix():
    assert held_back("Paris\nQ", ["\nQ:"]) == 2
    assert held_back("Paris", ["\nQ:"]) == 0
    assert held_back("abc", ["c", "bcd"]) == 2  # the longer possible beginning is kept back
    tracker = DecodedText(lambda ids: "".join(chr(i) for i in ids), stop=["cd"])
    assert not tracker.add([ord("a"), ord("b"), ord("c")])
    assert tracker.visible() == "ab" and tracker.visible(final=True) == "abc"
    assert tracker.add([ord(x) for x in "abcd"]) and tracker.text == "ab"


@pytest.mark.parametrize("name, mode", [("tiny-llama", "full"), ("tiny-qwen3-vl", "pop"), ("tiny-qwen3", "pop")])
def test_stop_string_split_across_tokens_ends_the_answer(pipelines, picture, name, mode):
    pipe = pipelines(name)
    plain = greedy(pipe, picture, mode=mode)
    stop, at = split_stop(pipe, plain)
    stopped = greedy(pipe, picture, mode=mode, stop=[stop, "never seen \x00"])
    assert stopped.text == plain.text[:at] and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(plain.token_ids)  # decoding stopped there, not at max_new_tokens
    pieces = list(pipe.stream(image_for(pipe, picture), QUESTION, mode=mode, max_new_tokens=16, stop=stop))
    assert "".join(pieces[:-1]) == stopped.text  # nothing past the stop string was ever streamed


def test_a_held_back_beginning_of_a_stop_string_is_released_when_it_does_not_complete(pipelines, picture):
    pipe = pipelines("tiny-llama")
    plain = greedy(pipe, picture)
    start, at = split_stop(pipe, plain)
    stop = start + "\x00 not in the text"
    pieces = list(pipe.stream(None, QUESTION, max_new_tokens=16, stop=stop))
    answer = pieces[-1]
    assert answer.text == plain.text and answer.finish_reason == "length"
    # the token ending inside `start` left a text ending with the beginning of the stop string: it was held back
    # until the next token showed that the stop string does not follow, so no stream position falls inside `start`
    shown = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces) - 1)]
    assert not [n for n in shown if at < n < at + len(start)], (shown, at)
    assert "".join(pieces[:-1]) == plain.text


def test_stop_strings_are_checked(pipelines):
    with pytest.raises(ValueError, match="stop"):
        pipelines("tiny-llama").answer(None, QUESTION, stop=[""])


# ---- n choices ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-text"])
def test_greedy_choices_equal_the_single_answer_and_share_one_prefill(pipelines, picture, name, monkeypatch):
    """Each choice decodes from its own copy of the prefilled cache: were the cache shared, the second choice
    would see the first one's tokens and answer differently."""
    pipe = pipelines(name)
    single = greedy(pipe, picture, tokens=8, mode="pop")
    calls = []
    real_prefill = pop_vlm.generate.prefill
    monkeypatch.setattr(pop_vlm.generate, "prefill", lambda *a, **k: calls.append(1) or real_prefill(*a, **k))
    answer = greedy(pipe, picture, tokens=8, mode="pop", n=3)
    assert len(calls) == 1
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids and c.text == single.text for c in answer.choices)
    assert answer.timings.n_generated_tokens == 3 * len(single.token_ids)


def test_sampled_choices_differ_and_repeat_with_the_seed(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    kwargs = dict(mode="pop", do_sample=True, temperature=1.5, seed=11, n=3)
    a, b = greedy(pipe, picture, tokens=6, **kwargs), greedy(pipe, picture, tokens=6, **kwargs)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) == 3
    streamed = list(pipe.stream(picture, QUESTION, max_new_tokens=6, **kwargs))
    for choice in a.choices:
        assert "".join(p for p in streamed[:-1] if p.index == choice.index) == choice.text


# ---- log-probabilities --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "pop"])
def test_logprobs_are_those_of_the_logits_sampled_from(pipelines, picture, mode):
    pipe = pipelines("tiny-qwen3-vl")
    answer = greedy(pipe, picture, tokens=6, mode=mode, logprobs=True, top_logprobs=3, output_scores=True)
    assert len(answer.logprobs) == len(answer.token_ids) == len(answer.scores)
    for token, lp, scores in zip(answer.token_ids, answer.logprobs, answer.scores):
        expected = torch.log_softmax(scores.float(), -1)
        assert lp.token_id == token and lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert [t for t, _ in lp.top] == torch.topk(expected, 3).indices.tolist()
        assert lp.top[0][0] == token  # greedy picks the most likely token
    streamed = list(pipe.stream(picture, QUESTION, mode=mode, max_new_tokens=6, logprobs=True, top_logprobs=3))
    assert [lp for piece in streamed[:-1] for lp in piece.logprobs] == answer.logprobs


def test_pop_first_token_logprobs_come_from_the_boundary_step(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    first = {}
    for label, mode, pop in [("full", "full", None), ("pop", "pop", PopConfig(prune_layers=2)),
                             ("pop-k0", "pop", PopConfig(prune_layers=0)),
                             ("no-boundary", "pop", PopConfig(prune_layers=2, boundary=False))]:
        answer = greedy(pipe, picture, tokens=1, mode=mode, pop=pop, logprobs=True, top_logprobs=5)
        first[label] = answer.logprobs[0].top
    assert [t for t, _ in first["pop-k0"]] == [t for t, _ in first["full"]]
    assert [v for _, v in first["pop-k0"]] == pytest.approx([v for _, v in first["full"]], abs=1e-4)
    # the boundary step's full-model logits, not the pruned stack's
    assert [v for _, v in first["pop"]] != pytest.approx([v for _, v in first["no-boundary"]], abs=1e-4)


# ---- penalties ----------------------------------------------------------------------------------------------------
def test_penalty_formula_and_greedy_choice():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    penalised = apply_penalties(torch.zeros(3), torch.tensor([0, 1, 3]), params)
    assert penalised.tolist() == [0.0, -1.5, -3.5]
    logits = torch.tensor([2.0, 1.9])
    assert sample_token(logits, params, None, torch.tensor([1, 0])) == 1
    assert sample_token(logits, SamplingParams(), None, torch.tensor([1, 0])) == 0
    for bad in (2.5, -3, True, "1"):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(presence_penalty=bad)


@pytest.mark.parametrize("name, penalty, fewer_repeats", [("tiny-gemma3-text", 2.0, True), ("tiny-llama", -2.0, False)])
def test_penalties_steer_the_loop(pipelines, picture, name, penalty, fewer_repeats):
    """Each step picks the argmax of the raw logits less the penalty of the tokens generated before it."""
    pipe = pipelines(name)
    plain = greedy(pipe, picture, tokens=16)
    answer = greedy(pipe, picture, tokens=16, presence_penalty=penalty, frequency_penalty=penalty / 2,
                    output_scores=True)
    params = SamplingParams(presence_penalty=penalty, frequency_penalty=penalty / 2)
    counts = torch.zeros(answer.scores[0].shape[-1], dtype=torch.int32)
    for token, scores in zip(answer.token_ids, answer.scores):
        assert token == int(torch.argmax(apply_penalties(scores, counts, params)))
        counts[token] += 1
    distinct, plain_distinct = len(set(answer.token_ids)), len(set(plain.token_ids))
    assert distinct > plain_distinct if fewer_repeats else distinct < plain_distinct


def test_extreme_sampling_settings_still_sample():
    """Found by the API fuzzer: temperatures and top_p values below float32's range made the probabilities nan."""
    logits = torch.tensor([1.0, 3.0, 2.0])
    for temperature, top_p in [(5e-324, 1.0), (1.0, 5e-324), (5.6e-218, 5.6e-218), (1e-30, 0.5)]:
        params = SamplingParams(do_sample=True, temperature=temperature, top_p=top_p)
        assert sample_token(logits, params, torch.Generator().manual_seed(0)) == 1
