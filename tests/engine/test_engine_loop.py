"""EngineLoop on a tiny Mixtral: batched = alone outputs, admission, chunking, cancel, deadlines, errors, stop."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.config import EngineConfig
from moed.engine.engine_loop import EngineLoop
from moed.engine.offline_run import Completion, run_offline
from moed.engine.request import GenerationRequest, RequestHandle, StreamEvent
from moed.engine.runtime import ModelRuntime, open_runtime
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError, QueueFullError

CTX = 128
TEXTS = ("The router reads the weights quickly.", "A quick brown fox jumps over a lazy dog", "Un café à Paris",
         "def add(a, b):", "The scheduler keeps every request", "hello", "Numbers: 1, 22, 333",
         "日本語のテキスト")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> ModelRuntime:
    path = tmp_path_factory.mktemp("tiny-mixtral")
    build_tiny_model("mixtral", path)
    write_tiny_tokenizer(path)
    rt = open_runtime(path, engine=EngineConfig(device="cpu"))
    yield rt
    rt.close()


@pytest.fixture
def make_loop(runtime):
    loops = []

    def make(**kwargs) -> EngineLoop:
        kwargs.setdefault("context_length", CTX)
        loop = EngineLoop(runtime, name="tiny", **kwargs)
        loop.start()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        assert loop.stop(cancel_inflight=True, timeout=10), "the loop thread did not end"


def prompt(runtime, i: int) -> list[int]:
    return runtime.tokenizer.encode(TEXTS[i])


def reference(runtime, prompt_ids, params) -> Completion:
    """The same request run alone, on a loop of its own (call while no other loop is generating: one model).

    What a request produces must not depend on what else is in its batch; the finish reasons
    themselves are checked against scripted outputs in test_finish_reasons.py.
    """
    return run_offline(runtime, [prompt_ids], [params], context_length=CTX)[0]


def collect(handle: RequestHandle, timeout: float = 30) -> tuple[list[int], str, StreamEvent]:
    events = list(handle.events(timeout=timeout))
    assert events[-1].done and not any(e.done for e in events[:-1])
    assert all(len(e.token_ids) == 1 for e in events[:-1]), "one event per token"
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def blocker(loop: EngineLoop) -> threading.Event:
    """Park the loop thread at a safe point until the returned event is set (nothing is scheduled meanwhile)."""
    release, parked = threading.Event(), threading.Event()
    loop.run_at_safe_point(lambda: (parked.set(), release.wait(10)))
    assert parked.wait(10)
    return release


def test_concurrent_requests_match_each_request_run_alone(runtime, make_loop):
    long_prompt = runtime.tokenizer.encode(" ".join(TEXTS) * 3)[: CTX - 6]
    cases = [(prompt(runtime, i), greedy(16 + i)) for i in range(5)]
    cases.append((prompt(runtime, 1), SamplingParams(max_tokens=24, stop=("amp",))))
    cases.append((prompt(runtime, 5), SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11)))
    cases.append((long_prompt, greedy(50)))
    refs = [reference(runtime, p, sp) for p, sp in cases]
    assert refs[5].finish_reason == "stop" and refs[7].finish_reason == "context", "cases must cover both"

    loop = make_loop(max_batch=8)
    barrier = threading.Barrier(len(cases))
    outputs: list = [None] * len(cases)

    def client(i: int) -> None:
        barrier.wait()
        outputs[i] = collect(loop.submit(GenerationRequest(f"req-{i}", *cases[i])))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (tokens, text, final), ref, (p, sp) in zip(outputs, refs, cases):
        assert tokens == ref.token_ids
        assert text == ref.text
        assert final.finish_reason == ref.finish_reason
        assert final.usage.prompt_tokens == len(p) and final.usage.completion_tokens == len(tokens)
    assert outputs[6][2].usage.seed == 11
    assert loop.max_batch_seen > 1, "continuous batching never put two sequences in one step"
    assert loop.requests_served == len(cases) and loop.num_active == 0 and loop.state == "idle"


def test_a_request_arriving_mid_decode_is_admitted_without_waiting(runtime, make_loop):
    p_long, p_short = prompt(runtime, 0), prompt(runtime, 3)
    ref_long = reference(runtime, p_long, greedy(CTX - len(p_long) - 1))
    ref_short = reference(runtime, p_short, greedy(3))
    loop = make_loop(max_batch=4)
    long_handle = loop.submit(GenerationRequest("long", p_long, greedy(CTX - len(p_long) - 1)))
    long_events = long_handle.events(timeout=30)
    first = [next(long_events) for _ in range(3)]
    assert loop.state == "generating" and loop.num_active == 1
    tokens, _, final = collect(loop.submit(GenerationRequest("short", p_short, greedy(3))))
    assert tokens == ref_short.token_ids and final.finish_reason == "length"
    assert loop.num_active == 1, "the long request must still be decoding after the short one finished"
    assert loop.max_batch_seen == 2 and loop.tokens_per_second > 0
    assert long_handle.cancel()
    rest = list(long_events)
    long_tokens = [t for e in first + rest for t in e.token_ids]
    assert rest[-1].finish_reason == "cancelled"
    assert long_tokens == ref_long.token_ids[: len(long_tokens)] and len(long_tokens) < len(ref_long.token_ids)


def test_chunked_prefill_gives_the_unchunked_tokens(runtime, make_loop):
    long_prompt = runtime.tokenizer.encode(" ".join(TEXTS) * 2)[:90]
    short = prompt(runtime, 2)
    ref_long = reference(runtime, long_prompt, greedy(12))
    ref_short = reference(runtime, short, greedy(30))
    loop = make_loop(max_batch=2, prefill_chunk=4, max_step_tokens=6)
    release = blocker(loop)
    handles = [loop.submit(GenerationRequest("long", long_prompt, greedy(12))),
               loop.submit(GenerationRequest("short", short, greedy(30)))]
    release.set()
    (long_tokens, _, _), (short_tokens, _, _) = map(collect, handles)
    assert long_tokens == ref_long.token_ids and short_tokens == ref_short.token_ids
    assert loop.num_steps >= len(long_prompt) // 4, "the prompt was not fed in chunks of 4"


def test_cancel_mid_stream_frees_the_slot_and_the_request_state(runtime, make_loop):
    p_next = prompt(runtime, 4)
    ref_next = reference(runtime, p_next, greedy(10))
    loop = make_loop(max_batch=1)
    request = GenerationRequest("victim", prompt(runtime, 0), greedy(CTX - 20))
    alive = weakref.ref(request)
    handle = loop.submit(request)
    del request
    events = handle.events(timeout=30)
    for _ in range(3):
        assert not next(events).done
    assert handle.cancel()
    final = list(events)[-1]
    assert final.finish_reason == "cancelled" and 3 <= final.usage.completion_tokens < CTX - 20
    assert loop.num_active == 0 and not handle.cancel(), "a finished request cannot be cancelled again"
    for _ in range(100):  # the loop thread may still be unwinding the step that finished it
        gc.collect()
        if alive() is None:
            break
        time.sleep(0.01)
    assert alive() is None, "the engine still references the cancelled request"
    tokens, _, _ = collect(loop.submit(GenerationRequest("next", p_next, greedy(10))))
    assert tokens == ref_next.token_ids


def test_a_reused_slot_never_sees_the_previous_sequence(runtime, make_loop):
    p_first, p_second = runtime.tokenizer.encode(" ".join(TEXTS))[:80], prompt(runtime, 6)
    ref_second = reference(runtime, p_second, greedy(15))
    loop = make_loop(max_batch=1)
    collect(loop.submit(GenerationRequest("first", p_first, greedy(20))))  # fills positions 0..99 of slot 0

    def poison() -> None:  # whatever the next sequence reads without having written it is garbage
        generator = torch.Generator().manual_seed(0)
        for entries in loop._cache.layers:
            for store in entries.values():
                store.copy_(torch.randn(store.shape, generator=generator) * 1e3)

    loop.run_at_safe_point(poison).result(10)
    tokens, _, _ = collect(loop.submit(GenerationRequest("second", p_second, greedy(15))))
    assert tokens == ref_second.token_ids


def test_deadline_ends_the_request(runtime, make_loop, monkeypatch):
    forward = runtime.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.02)  # the whole request takes at least 2.4 s: far past the 1 s deadline
        return forward(*args, **kwargs)

    monkeypatch.setattr(runtime.model, "forward", slow_forward)
    loop = make_loop()
    p = prompt(runtime, 0)
    handle = loop.submit(GenerationRequest("late", p, greedy(CTX - len(p) - 1), deadline=time.monotonic() + 1.0))
    tokens, _, final = collect(handle)
    assert final.finish_reason == "deadline" and 0 < len(tokens) < CTX - len(p) - 1
    expired = loop.submit(GenerationRequest("expired", p, greedy(5), deadline=time.monotonic() - 1))
    tokens, _, final = collect(expired)
    assert final.finish_reason == "deadline" and tokens == [] and final.usage.completion_tokens == 0


def test_full_queue_raises_and_invalid_requests_never_queue(runtime, make_loop):
    loop = make_loop(max_batch=1, max_queue=2)
    vocab = runtime.model.config.vocab_size
    release = blocker(loop)
    handles = [loop.submit(GenerationRequest(f"q{i}", prompt(runtime, i), greedy(3))) for i in range(2)]
    with pytest.raises(QueueFullError, match="max_queue=2"):
        loop.submit(GenerationRequest("q2", prompt(runtime, 2), greedy(3)))
    bad = [([], "empty"), (list(range(1, CTX + 1)), "context"), ([5, vocab], "vocabulary"), ([5, -1], "vocabulary")]
    for ids, words in bad:
        with pytest.raises(InvalidRequestError, match=words):
            loop.submit(GenerationRequest("bad", ids, greedy(3)))
    with pytest.raises(InvalidRequestError, match="already queued"):
        loop.submit(GenerationRequest("q0", [5], greedy(3)))
    assert loop.num_queued == 2
    release.set()
    assert [collect(h)[2].finish_reason for h in handles] == ["length", "length"]


def test_safe_points_run_between_steps_without_changing_outputs(runtime, make_loop, monkeypatch):
    cases = [(prompt(runtime, i), greedy(25)) for i in range(4)]
    refs = [reference(runtime, p, sp) for p, sp in cases]
    in_forward = threading.Event()
    forward = runtime.model.forward

    def watched_forward(*args, **kwargs):
        in_forward.set()
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward.clear()

    monkeypatch.setattr(runtime.model, "forward", watched_forward)
    loop = make_loop(max_batch=4)
    handles = [loop.submit(GenerationRequest(f"s{i}", *case)) for i, case in enumerate(cases)]
    seen = []
    for _ in range(10):
        seen.append(loop.run_at_safe_point(
            lambda: (threading.current_thread().name, in_forward.is_set(), loop.num_active)).result(10))
    outputs = [collect(h)[0] for h in handles]
    assert outputs == [r.token_ids for r in refs]
    assert all(name == "moed-engine-tiny" and not busy for name, busy, _ in seen)
    assert any(active > 0 for _, _, active in seen), "no safe point ran while requests were in flight"
    started = time.monotonic()
    assert loop.run_at_safe_point(lambda: 42).result(5) == 42  # idle: served promptly (woken, not polled)
    assert time.monotonic() - started < 2.0
    with pytest.raises(ZeroDivisionError):
        loop.run_at_safe_point(lambda: 1 / 0).result(5)


def test_a_failing_model_step_errors_its_requests_and_the_loop_keeps_serving(runtime, make_loop, monkeypatch):
    p_next = prompt(runtime, 7)
    ref_next = reference(runtime, p_next, greedy(8))
    refs = [reference(runtime, prompt(runtime, i), greedy(10)) for i in range(2)]
    forward, calls = runtime.model.forward, [0]

    def flaky_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected expert failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runtime.model, "forward", flaky_forward)
    loop = make_loop(max_batch=4)
    release = blocker(loop)
    handles = [loop.submit(GenerationRequest(f"e{i}", prompt(runtime, i), greedy(10))) for i in range(2)]
    release.set()
    for handle, ref in zip(handles, refs):
        tokens, _, final = collect(handle)
        assert final.finish_reason == "error" and "injected expert failure" in final.error
        assert tokens == ref.token_ids[:2]  # steps 1 and 2 sampled; step 3 failed
    assert "injected expert failure" in loop.last_error and loop.num_active == 0
    tokens, _, final = collect(loop.submit(GenerationRequest("after", p_next, greedy(8))))
    assert final.finish_reason == "length" and tokens == ref_next.token_ids


def test_stop_without_cancelling_drains_running_and_queued_requests(runtime, make_loop):
    loop = make_loop(max_batch=2)
    release = blocker(loop)
    handles = [loop.submit(GenerationRequest(f"d{i}", prompt(runtime, i), greedy(6))) for i in range(3)]
    stopper = threading.Thread(target=loop.stop, kwargs=dict(cancel_inflight=False, timeout=30))
    stopper.start()
    for i in range(200):  # once stop() has run, new submits are refused while the backlog drains
        try:
            handles.append(loop.submit(GenerationRequest(f"late{i}", prompt(runtime, 3), greedy(6))))
        except InvalidRequestError as exc:
            assert "shutting down" in str(exc)
            break
        time.sleep(0.005)
    else:
        pytest.fail("submit was still accepted after stop()")
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert all(collect(h)[2].finish_reason == "length" for h in handles)
    assert loop.requests_served == len(handles)


def test_stop_cancels_running_and_queued_requests(runtime, make_loop):
    loop = make_loop(max_batch=1)
    running = loop.submit(GenerationRequest("r", prompt(runtime, 0), greedy(CTX - 20)))
    queued = loop.submit(GenerationRequest("q", prompt(runtime, 1), greedy(CTX - 20)))
    events = running.events(timeout=30)
    assert not next(events).done
    assert loop.stop(cancel_inflight=True, timeout=10)
    assert list(events)[-1].finish_reason == "cancelled"
    tokens, _, final = collect(queued)
    assert final.finish_reason == "cancelled" and tokens == []
    with pytest.raises(InvalidRequestError, match="shutting down"):
        loop.submit(GenerationRequest("after", prompt(runtime, 2), greedy(3)))
