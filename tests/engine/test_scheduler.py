"""Scheduler without a model: admission into slots, decode-first chunked prefill under a token budget, cancel."""

from __future__ import annotations

import pytest

from moed.engine.scheduler import Scheduler, SchedulerConfig
from moed.errors import InvalidRequestError, QueueFullError


def make(max_batch=2, max_queue=4, prefill_chunk=4, max_step_tokens=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_batch, max_queue, prefill_chunk, max_step_tokens))


def run_step(sched: Scheduler, next_token=lambda seq_id, n: 1000 + 10 * seq_id + n):
    """Pretend the model ran the plan: record every chunk, sample a token where the plan says so."""
    plan = sched.schedule()
    sampled = {}
    for chunk in plan.chunks:
        token = next_token(chunk.seq_id, chunk.start) if chunk.samples else None
        sched.record(chunk.seq_id, len(chunk.token_ids), token)
        sampled[chunk.seq_id] = token
    return plan, sampled


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_batch=0), "max_batch"), (dict(max_queue=0), "max_queue"), (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(max_batch=8, max_step_tokens=4), "max_step_tokens"), (dict(max_batch=2.5), "max_batch"),
])
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SchedulerConfig(**kwargs)


def test_queue_is_bounded_and_request_ids_unique():
    sched = make(max_batch=1, max_queue=2)
    sched.add("a", [1, 2])
    sched.add("b", [1, 2])
    with pytest.raises(QueueFullError, match="max_queue=2"):
        sched.add("c", [1])
    with pytest.raises(InvalidRequestError, match="'a'"):
        sched.add("a", [1])
    assert sched.num_waiting == 2
    sched.schedule()  # "a" takes the only slot, freeing a queue place
    assert sched.num_waiting == 1 and sched.num_running == 1
    sched.add("c", [1])
    assert sched.num_waiting == 2


def test_admission_is_fifo_into_free_slots_and_a_freed_slot_is_reused_at_once():
    sched = make(max_batch=2)
    ids = [sched.add(f"r{i}", [5, 6]) for i in range(3)]
    plan = sched.schedule()
    assert plan.admitted == ids[:2] and [c.slot for c in plan.chunks] == [0, 1]
    assert sched.num_waiting == 1 and sched.free_slots == []
    for chunk in plan.chunks:
        sched.record(chunk.seq_id, len(chunk.token_ids), 7)
    assert sched.finish(ids[0])
    plan = sched.schedule()  # the waiting request joins while ids[1] keeps decoding
    assert plan.admitted == [ids[2]]
    by_seq = {c.seq_id: c for c in plan.chunks}
    assert by_seq[ids[2]].slot == 0 and by_seq[ids[2]].start == 0 and by_seq[ids[2]].token_ids == [5, 6]
    assert by_seq[ids[1]].token_ids == [7] and by_seq[ids[1]].start == 2
    assert not sched.finish(ids[0]), "finishing twice must report an unknown sequence"


def test_decodes_come_first_then_prefill_chunks_in_fifo_order_within_the_budget():
    sched = make(max_batch=4, prefill_chunk=4, max_step_tokens=8)
    short = [sched.add(f"s{i}", [1]) for i in range(2)]
    run_step(sched)  # both one-token prompts prefill and sample
    long_a = sched.add("long-a", list(range(10, 20)))
    long_b = sched.add("long-b", list(range(30, 36)))
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == short + [long_a, long_b]
    assert [len(c.token_ids) for c in plan.chunks] == [1, 1, 4, 2]  # budget 8 = 2 decodes + 4 + 2
    assert plan.num_tokens == 8
    a, b = plan.chunks[2], plan.chunks[3]
    assert a.token_ids == [10, 11, 12, 13] and not a.samples
    assert b.token_ids == [30, 31] and not b.samples


def test_a_long_prompt_never_delays_decodes():
    sched = make(max_batch=2, prefill_chunk=64, max_step_tokens=3)
    decoder = sched.add("d", [1])
    run_step(sched)
    long_id = sched.add("long", list(range(100, 130)))
    for _ in range(15):
        plan, sampled = run_step(sched)
        assert plan.chunks[0].seq_id == decoder and sampled[decoder] is not None
        assert plan.num_tokens <= 3
    long_chunk = next(c for c in sched.schedule().chunks if c.seq_id == long_id)
    assert long_chunk.start == 30  # 15 steps x 2 spare tokens


def test_fed_tokens_replay_each_sequence_exactly_once_in_order():
    sched = make(max_batch=2, max_queue=8, prefill_chunk=3, max_step_tokens=5)
    prompts = {f"r{i}": list(range(100 * i, 100 * i + 2 + 3 * i)) for i in range(5)}
    seq_ids = {sched.add(rid, p): rid for rid, p in prompts.items()}
    fed = {s: [] for s in seq_ids}
    generated = {s: [] for s in seq_ids}
    for _ in range(200):
        plan = sched.schedule()
        if not plan.chunks:
            break
        assert len(plan.chunks) <= 2 and plan.num_tokens <= 5
        for chunk in plan.chunks:
            assert chunk.start == len(fed[chunk.seq_id]), "a chunk must continue where the slot's cache ends"
            fed[chunk.seq_id] += chunk.token_ids
            token = 7000 + len(generated[chunk.seq_id]) if chunk.samples else None
            sched.record(chunk.seq_id, len(chunk.token_ids), token)
            if token is not None:
                generated[chunk.seq_id].append(token)
                if len(generated[chunk.seq_id]) == 4:
                    sched.finish(chunk.seq_id)
    assert sched.num_running == 0 and sched.num_waiting == 0 and sched.free_slots == [0, 1]
    for seq_id, rid in seq_ids.items():
        # the last sampled token is never fed: the sequence finished
        assert fed[seq_id] == prompts[rid] + generated[seq_id][:-1]


def test_cancel_removes_queued_and_marks_running():
    sched = make(max_batch=1)
    running = sched.add("run", [1, 2])
    queued = sched.add("wait", [3])
    sched.schedule()
    gone = sched.cancel("wait")
    assert gone.seq_id == queued and gone.was_queued and sched.num_waiting == 0
    marked = sched.cancel("run")
    assert marked.seq_id == running and not marked.was_queued
    plan = sched.schedule()
    assert plan.cancelled == [running] and plan.chunks == [], "a cancelled sequence must not be fed"
    assert sched.num_running == 1, "the slot stays taken until the caller finishes the sequence"
    sched.finish(running)
    assert sched.free_slots == [0] and sched.cancel("run") is None
    sched.add("run", [9])  # the id is free again


def test_prefill_chunks_end_exactly_at_the_stops_and_a_kv_hook_can_defer_admission():
    asked = []

    def on_admit(seq_id, tokens):
        asked.append(seq_id)
        return None if seq_id == 1 and asked.count(1) <= 2 else 2  # seq 1 waits twice for KV room

    sched = Scheduler(SchedulerConfig(2, 4, 8, 16), on_admit=on_admit, stops=lambda s, t, cached: (5, 11))
    sched.add("a", list(range(20)))
    plan, _ = run_step(sched)
    assert [(c.start, len(c.token_ids)) for c in plan.chunks] == [(2, 3)]  # 2 cached; the chunk ends at 5
    plan, _ = run_step(sched)
    assert [(c.start, len(c.token_ids)) for c in plan.chunks] == [(5, 6)]  # ends at 11
    plan, _ = run_step(sched)
    assert [(c.start, len(c.token_ids)) for c in plan.chunks] == [(11, 8)]  # then full chunks
    sched.add("b", [1, 2, 3])
    for _ in range(2):
        plan, _ = run_step(sched)
        assert plan.admitted == [] and sched.num_waiting == 1  # deferred: first in line, not dropped
    plan, _ = run_step(sched)
    assert plan.admitted == [1]
