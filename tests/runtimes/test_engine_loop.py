"""The engine's long-lived step loop (attnx.runtimes.engine_loop.EngineLoop, what attnx serve runs): requests submitted
from other threads join between steps with the same greedy tokens as attnx generate's, alone or beside others, their
prompts prefilled in chunks between steps; a cancelled row or prompt leaves; a full queue, a request past the cache
and a closed loop are refused; close() ends the rest."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from attnx.errors import InputError
from attnx.runtimes.engine_loop import EngineClosed, EngineLoop, QueueFull
from attnx.runtimes.generate import Request
from attnx.runtimes.model_package import engine_for
from attnx.runtimes.package import load
from attnx.runtimes.sampling import Sampling
from attnx.workflows import build_model_package

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop") / "pkg"
    build_model_package(str(FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"), out,
                        checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))  # fmt: skip
    with load(out) as loaded:
        yield loaded


def _prompts(lengths=(5, 12, 3, 21, 9)) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(3, 256, n)] for n in lengths]


def _serve(loop: EngineLoop, prompts, new=NEW, **request) -> list[Request]:
    """Each prompt submitted (one thread), each waited for: the requests once they ended."""
    done = [threading.Event() for _ in prompts]
    requests = [Request(i, p, new, on_finish=lambda r: done[r.index].set(), **request) for i, p in enumerate(prompts)]
    for r in requests:
        loop.submit(r)
    for event in done:
        assert event.wait(60)
    return requests


def test_a_requests_greedy_tokens_are_the_same_alone_and_beside_others(model):
    """The buffer form's cache sized once for the model's context (128 positions, 4 rows): each prompt alone, then
    all five at once (rows joining between steps as others end), the tokens attnx generate gives."""
    prompts = _prompts()
    truth = model.generate(prompts, max_new_tokens=NEW, max_batch=1)
    with EngineLoop(engine_for(model.runner, model.manifest, 4)) as loop:
        assert loop.max_len == model.context == 128 and loop.engine.io.form == "buffer"
        alone = [_serve(loop, [p])[0] for p in prompts]
        together = _serve(loop, prompts)
        assert loop.engine.stats.largest_batch == 4
    assert [r.tokens for r in alone] == [r.tokens for r in together] == truth
    assert {r.finish for r in together} == {"length"}


def test_tokens_reach_the_listener_as_made_and_a_listener_can_end_its_request(model):
    prompt = _prompts((7,))[0]
    seen: list[int] = []

    def on_token(r: Request) -> None:
        seen.append(r.tokens[-1])
        if len(r.tokens) == 4:
            r.stop()

    with EngineLoop(engine_for(model.runner, model.manifest, 2)) as loop:
        (request,) = _serve(loop, [prompt], on_token=on_token)
        assert loop.running == 0
    assert request.finish == "stop" and seen == request.tokens and len(seen) == 4


def test_a_cancelled_row_leaves_at_the_next_step_and_the_others_go_on(model):
    """The loop's thread is held inside the first request's third token (its listener waits), so nothing moves while
    a second request is queued and the first cancelled: released, the first leaves at the next step, never near its
    100 tokens, and the second is served to the end with the tokens it gets alone."""
    prompts = _prompts((6, 9))
    truth = model.generate(prompts[1:], max_new_tokens=40, max_batch=1)[0]
    started, go, ended, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def hold_at_3(r: Request) -> None:
        if len(r.tokens) == 3:
            started.set()
            go.wait(60)

    with EngineLoop(engine_for(model.runner, model.manifest, 2)) as loop:
        first = Request(0, prompts[0], 100, on_token=hold_at_3, on_finish=lambda r: ended.set())
        loop.submit(first)
        assert started.wait(60)
        other = Request(1, prompts[1], 40, on_finish=lambda r: done.set())
        loop.submit(other)
        loop.cancel(first)
        go.set()
        assert ended.wait(60) and done.wait(60)
        # on_finish runs on the loop's thread before the ended rows leave the batch (drop_done, the same step)
        deadline = time.monotonic() + 60
        while loop.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.running == 0
    assert first.finish == "cancelled" and 3 <= len(first.tokens) <= 4
    assert other.tokens == truth


def test_a_full_queue_a_request_past_the_cache_and_a_closed_loop_are_refused(model):
    """max_queue 1: while the loop's thread is held (a listener waits), one request waits and the next is refused;
    prompt + max_new_tokens past the 128 positions is refused whole; close(0) ends a running request ("abort")."""
    release, held = threading.Event(), threading.Event()

    def hold(r: Request) -> None:
        held.set()
        release.wait(60)

    loop = EngineLoop(engine_for(model.runner, model.manifest, 1), max_queue=1).start()
    try:
        with pytest.raises(InputError, match="maximum context length is 128 tokens; this request asks 130"):
            loop.submit(Request(0, [5] * 30, 100))
        running = Request(0, [5, 6, 7], 100, on_token=hold)
        loop.submit(running)
        assert held.wait(60)
        loop.submit(Request(1, [5, 6], 4))
        with pytest.raises(QueueFull, match="1 requests wait already"):
            loop.submit(Request(2, [5, 6], 4))
        assert loop.waiting == 1
        release.set()
    finally:
        release.set()
        loop.close(0.0)
    assert running.finish == "abort" and 0 < len(running.tokens) < 100
    with pytest.raises(EngineClosed, match="shutting down"):
        loop.submit(Request(3, [5], 2))


def test_sampled_requests_draw_from_their_own_generator(model):
    """Sampled tokens depend on the request's own seed alone: the same seed, the same tokens, beside others or not."""
    prompt = _prompts((8,))[0]
    sampling = Sampling(temperature=1.0, top_p=0.9)
    with EngineLoop(engine_for(model.runner, model.manifest, 4)) as loop:
        alone = _serve(loop, [prompt], sampling=sampling, rng=np.random.default_rng(5))[0]
        done = threading.Event()
        mine = Request(9, prompt, NEW, sampling=sampling, rng=np.random.default_rng(5), on_finish=lambda r: done.set())
        others = [Request(i, p, NEW, sampling=sampling, rng=np.random.default_rng(i)) for i, p in enumerate(_prompts())]
        for r in [*others[:2], mine, *others[2:]]:
            loop.submit(r)
        assert done.wait(60)
    assert len(alone.tokens) == NEW and mine.tokens == alone.tokens


def test_long_prompts_are_prefilled_in_chunks_between_the_steps_of_the_rows_decoding(model):
    """prefill_chunk 4: a first request decodes (held at its first token while three prompts of 5, 21 and 12 tokens
    queue); released, each step prefills at most 4 prompt tokens before the rows decode, so the first of the three
    makes tokens while the 21-token prompt is still going in (whole prompts would give all three their first token
    before any step). The first of the three ends (2 new tokens) while the second's prompt is going in, so that
    prompt's part moves slots: every request's tokens are attnx generate's."""
    prompts = _prompts((5, 21, 12))
    truth = model.generate(prompts, max_new_tokens=NEW, max_batch=1)
    events: list[tuple[int, int]] = []
    go, done = threading.Event(), [threading.Event() for _ in range(4)]

    def on_token(r: Request) -> None:
        events.append((r.index, len(r.tokens)))
        if r.index == 3 and len(r.tokens) == 1:
            go.wait(60)

    with EngineLoop(engine_for(model.runner, model.manifest, 4), prefill_chunk=4) as loop:
        held = Request(3, [5, 6], 40, on_token=on_token, on_finish=lambda r: done[3].set())
        loop.submit(held)  # no row decodes yet: its prompt goes in whole; it holds the loop at its first token
        while not events:
            time.sleep(0.01)
        requests = [Request(i, p, 2 if i == 0 else NEW, on_token=on_token, on_finish=lambda r: done[r.index].set())
                    for i, p in enumerate(prompts)]  # fmt: skip
        for r in requests:
            loop.submit(r)
        go.set()
        assert all(e.wait(60) for e in done)
        assert loop.engine.stats.prefills == 4
    assert requests[0].tokens == truth[0][:2]
    assert requests[1].tokens == truth[1] and requests[2].tokens == truth[2]
    assert events.index((0, 2)) < events.index((1, 1)) < events.index((2, 1))  # the first decoded as the rest went in
    assert events.index((3, 2)) < events.index((0, 1))  # the held row stepped while the first prompt went in


def test_a_prompt_cancelled_while_it_is_prefilled_frees_its_slot(model):
    """prefill_chunk 3: a first request decodes (held at its first token while two prompts queue); a 21-token prompt
    is cancelled from the first request's third token, in its second or third chunk: it ends "cancelled" with no
    token, and the 9-token prompt after it goes into the same slot and gets the tokens it gets alone."""
    prompts = _prompts((4, 21, 9))
    truth = model.generate([prompts[0], prompts[2]], max_new_tokens=NEW, max_batch=1)
    ended = [threading.Event() for _ in prompts]
    go, first = threading.Event(), threading.Event()
    with EngineLoop(engine_for(model.runner, model.manifest, 4), prefill_chunk=3) as loop:
        requests: list[Request] = []

        def on_token(r: Request) -> None:
            if len(r.tokens) == 1:
                first.set()
                go.wait(60)
            if len(r.tokens) == 3:
                loop.cancel(requests[1])

        requests.append(Request(0, prompts[0], NEW, on_token=on_token, on_finish=lambda r: ended[0].set()))
        loop.submit(requests[0])
        assert first.wait(60)
        requests += [Request(1, prompts[1], NEW, on_finish=lambda r: ended[1].set()),
                     Request(2, prompts[2], NEW, on_finish=lambda r: ended[2].set())]  # fmt: skip
        for r in requests[1:]:
            loop.submit(r)
        go.set()
        assert all(e.wait(60) for e in ended)
    assert requests[1].finish == "cancelled" and requests[1].tokens == []
    assert [requests[0].tokens, requests[2].tokens] == truth
