"""Continuous batching: a request decoded in a batch with others gives what it gives alone — tokens and logits —
while requests of different lengths and modes join and leave the running batch; a client that goes away frees its
row; a failing row fails alone; admission limits hold."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from pop_vlm import Pipeline, PopConfig, zoo
from pop_vlm.batch import Admission, BatchScheduler, DeviceTurns, QueueFull, WaitedTooLong

POP = PopConfig(prune_layers=2)


@pytest.fixture(scope="module")
def pipes():
    built = {}

    def get(name: str) -> Pipeline:
        if name not in built:
            model, processor = zoo.TINY[name]()
            built[name] = Pipeline(model, processor, name=name)
        return built[name]

    return get


def photo(side_w: int, side_h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side_h, side_w, 3), dtype=np.uint8))


def requests_for(pipe: Pipeline) -> list[dict]:
    """Six requests of different prompt lengths (images of different sizes; text longer than Gemma's window of 8),
    modes and answer lengths, so that rows join and leave the batch at different steps."""
    modes = ["full", "pop", "static", "pop", "full", "pop"]
    out = []
    for i, mode in enumerate(modes):
        question = "Tell me about the colours and the shapes you see here. " * (1 + i % 3)
        image = photo(32 + 24 * i, 40 + 16 * (i % 2), i) if pipe.is_multimodal else None
        out.append(dict(image=image, question=question, mode=mode, max_new_tokens=6 + 3 * i))
    return out


def run_concurrently(pipe: Pipeline, requests: list[dict], stagger_s: float = 0.02, **options) -> list:
    answers: list = [None] * len(requests)
    errors: list = [None] * len(requests)

    def work(i):
        time.sleep(stagger_s * i)  # later requests join a batch that is already decoding
        r = requests[i]
        try:
            answers[i] = pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP,
                                     max_new_tokens=r["max_new_tokens"], **options)
        except Exception as err:  # noqa: BLE001 - reported by the test
            errors[i] = err

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return answers, errors


@pytest.fixture
def batched():
    """Attach a scheduler to a pipeline for one test, and take it off again."""
    attached = []

    def attach(pipe: Pipeline, **kwargs) -> BatchScheduler:
        pipe.scheduler = BatchScheduler(pipe.adapter, **kwargs)
        attached.append(pipe)
        return pipe.scheduler

    yield attach
    for pipe in attached:
        pipe.scheduler.close()
        pipe.scheduler = None


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-vlm", "tiny-gemma3-text"])
def test_batched_requests_equal_each_request_alone(pipes, batched, name):
    pipe = pipes(name)
    requests = requests_for(pipe)
    alone = [pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP, max_new_tokens=r["max_new_tokens"],
                         output_scores=True, ignore_eos=True) for r in requests]
    assert len({a.n_prompt_tokens for a in alone}) >= 3  # ragged rows
    if name == "tiny-gemma3-text":
        assert min(a.n_prompt_tokens for a in alone) > pipe.adapter.config.sliding_window
    scheduler = batched(pipe, max_batch_size=4)
    answers, errors = run_concurrently(pipe, requests, output_scores=True, ignore_eos=True)
    assert errors == [None] * len(requests)
    for one, together in zip(alone, answers):
        assert together.token_ids == one.token_ids
        assert len(together.token_ids) == len(one.token_ids)
        for a, b in zip(one.scores, together.scores):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * float(a.abs().max()))
    stats = scheduler.stats
    assert stats.max_rows_in_step > 1  # requests really were decoded together
    assert stats.joined == stats.left == len(requests)
    assert scheduler.rows == 0


def test_batched_rows_keep_their_own_sampling_and_seed(pipes, batched):
    pipe = pipes("tiny-qwen3-vl")
    requests = requests_for(pipe)[:4]
    options = dict(do_sample=True, temperature=1.3, top_p=0.95, top_k=50, ignore_eos=True)
    seeded = [dict(r, seed=100 + i) for i, r in enumerate(requests)]
    alone = [pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP, max_new_tokens=r["max_new_tokens"],
                         seed=r["seed"], **options).token_ids for r in seeded]
    batched(pipe, max_batch_size=4)
    answers: list = [None] * len(seeded)

    def work(i):
        r = seeded[i]
        answers[i] = pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP,
                                 max_new_tokens=r["max_new_tokens"], seed=r["seed"], **options).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeded))]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert answers == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # different seeds: different samples


def test_a_client_that_goes_away_frees_its_row_and_the_others_finish(pipes, batched):
    pipe = pipes("tiny-qwen3-vl")
    requests = requests_for(pipe)[:3]
    alone = [pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP, max_new_tokens=12,
                         ignore_eos=True).token_ids for r in requests[1:]]
    scheduler = batched(pipe, max_batch_size=3)
    started = threading.Event()
    results: list = [None, None]

    def leaver():
        stream = pipe.stream(requests[0]["image"], requests[0]["question"], mode="pop", pop=POP, max_new_tokens=40,
                             ignore_eos=True)
        for count, _ in enumerate(stream):
            if count == 3:
                started.set()
                stream.close()  # what the server does when the client disconnects
                return

    def stayer(i):
        started.wait(60)
        r = requests[i + 1]
        results[i] = pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP, max_new_tokens=12,
                                 ignore_eos=True).token_ids

    threads = [threading.Thread(target=leaver)] + [threading.Thread(target=stayer, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert results == alone
    assert scheduler.rows == 0 and scheduler.stats.joined == scheduler.stats.left == 3
    for slots in scheduler._groups.values():  # nothing left behind: every slot free, its lengths zero
        assert slots.rows_in_use == 0 and int(slots.lengths.sum()) == 0
    assert not scheduler._tokens and not scheduler._pending


def test_a_failing_row_fails_alone(pipes, batched, monkeypatch):
    pipe = pipes("tiny-qwen3-vl")
    requests = requests_for(pipe)[:3]
    alone = [pipe.answer(r["image"], r["question"], mode=r["mode"], pop=POP, max_new_tokens=10,
                         ignore_eos=True).token_ids for r in requests]
    bad_question = requests[1]["question"]
    bad_length = pipe.build_inputs(requests[1]["image"], bad_question)["input_ids"].shape[1]
    real = pipe.adapter.decode_positions

    def broken(prompt, index, length=1):  # a row in a bad state: positions of the wrong shape
        positions = real(prompt, index, length)
        return torch.cat([positions, positions], dim=-1) if prompt.length == bad_length else positions

    monkeypatch.setattr(pipe.adapter, "decode_positions", broken)
    scheduler = batched(pipe, max_batch_size=3)
    for r in requests:
        r["max_new_tokens"] = 10
    answers, errors = run_concurrently(pipe, requests, stagger_s=0.0, ignore_eos=True)
    assert errors[1] is not None and "decode step failed" in str(errors[1])
    assert [answers[0].token_ids, answers[2].token_ids] == [alone[0], alone[2]]
    assert scheduler.stats.failed_rows >= 1 and scheduler.rows == 0


def test_follow_up_questions_continue_their_cached_conversation_in_the_batch(pipes, batched):
    pipe = pipes("tiny-qwen3-vl")
    image = photo(64, 48, 7)
    first = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Colour?"}]}]

    def conversation():
        pipe.prefix_cache.clear()
        *_, one = pipe.stream_chat(first, reuse_prefix=True, max_new_tokens=5, ignore_eos=True)
        follow = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "And the shape?"}]
        *_, two = pipe.stream_chat(follow, reuse_prefix=True, max_new_tokens=5, ignore_eos=True)
        return one.token_ids, two.token_ids, two.timings.n_cached_tokens

    alone = conversation()
    batched(pipe, max_batch_size=2)
    together = conversation()
    assert together == alone
    assert together[2] > 0  # the follow-up reused the first turn's cache


def test_admission_limits():
    admission = Admission(max_running=1, max_queue=1)
    entered = threading.Event()
    release = threading.Event()

    def hold():
        with admission.admitted():
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(10)
    with pytest.raises(WaitedTooLong):
        with admission.admitted(timeout_s=0.05):
            pass
    got_place = threading.Event()

    def wait_for_place():
        with admission.admitted(timeout_s=5):
            got_place.set()

    waiter = threading.Thread(target=wait_for_place)
    waiter.start()
    time.sleep(0.1)
    assert admission.waiting == 1
    with pytest.raises(QueueFull):  # one waiting already fills the queue of one
        with admission.admitted(timeout_s=5):
            pass
    release.set()
    holder.join(10)
    waiter.join(10)
    assert got_place.is_set()  # the waiter got the place when the holder left
    assert admission.waiting == 0 and admission.running == 0
    tokens = Admission(max_running=4, max_queue=4, max_tokens=100)
    with tokens.admitted(tokens=80):
        with pytest.raises(WaitedTooLong):
            with tokens.admitted(tokens=30, timeout_s=0.05):
                pass
        with tokens.admitted(tokens=20):
            assert tokens.tokens == 100


def test_device_turns_serve_in_arrival_order():
    turns = DeviceTurns()
    order = []
    holding = threading.Event()

    def first():
        with turns.turn():
            holding.set()
            time.sleep(0.2)
            order.append("first")

    def later(name, delay):
        time.sleep(delay)
        with turns.turn():
            order.append(name)

    threads = [threading.Thread(target=first), threading.Thread(target=later, args=("second", 0.05)),
               threading.Thread(target=later, args=("third", 0.1))]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert order == ["first", "second", "third"]


def test_rows_wait_for_room_in_the_token_budget(pipes, batched):
    pipe = pipes("tiny-qwen3-vl")
    requests = requests_for(pipe)[:3]
    alone = [pipe.answer(r["image"], r["question"], mode="pop", pop=POP, max_new_tokens=8, ignore_eos=True).token_ids
             for r in requests]
    scheduler = batched(pipe, max_batch_size=3, max_tokens=1)  # one row at a time: every other row must wait
    for r in requests:
        r["mode"], r["max_new_tokens"] = "pop", 8
    answers, errors = run_concurrently(pipe, requests, stagger_s=0.0, ignore_eos=True)
    assert errors == [None] * 3
    assert [a.token_ids for a in answers] == alone
    assert scheduler.stats.max_rows_in_step == 1 and scheduler.stats.joined == 3
