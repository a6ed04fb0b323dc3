"""The paged KV pool and the prefix cache on a tiny real model: a reused prefix changes speed, never results.

Each comparison runs the same requests with the prefix cache on and off (greedy tokens identical),
and counts what was reused through the requests' usage (``cached_tokens``: prompt tokens not
prefilled again).
"""

from __future__ import annotations

import os

import torch
import pytest

from helpers.tiny_models import build_tiny_model
from moed.config import EngineConfig
from moed.engine.engine_loop import EngineLoop
from moed.engine.kv_manager import KVManager
from moed.engine.request import GenerationRequest
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.runner.forward_batch import ForwardBatch

BS = 16


def _tiny_runtime(tmp_path_factory, family: str):
    path = tmp_path_factory.mktemp(family)
    build_tiny_model(family, path)
    rt = open_runtime(path, engine=EngineConfig(device="cpu"))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    yield from _tiny_runtime(tmp_path_factory, "qwen3_moe")


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(loop: EngineLoop, prompts: list[list[int]], max_tokens: int = 6) -> list[tuple[list[int], object]]:
    """Submit all at once; (tokens, usage) per prompt."""
    handles = [loop.submit(GenerationRequest(f"r{i}-{id(p)}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                                 ignore_eos=True)))
               for i, p in enumerate(prompts)]
    out = []
    for h in handles:
        tokens, usage = [], None
        for event in h.events(timeout=120):
            tokens.extend(event.token_ids)
            if event.done:
                assert event.finish_reason == "length", event
                usage = event.usage
        out.append((tokens, usage))
    return out


@pytest.fixture
def loops(runtime):
    made = []

    def make(prefix_cache: bool, **kwargs) -> EngineLoop:
        kwargs.setdefault("context_length", 256)
        loop = EngineLoop(runtime, name="tiny", prefix_cache=prefix_cache, **kwargs)
        loop.start()
        made.append(loop)
        return loop

    yield make
    for loop in made:
        assert loop.stop(timeout=10)


def test_a_follow_up_turn_prefills_only_its_new_suffix_and_generates_the_same_tokens(runtime, loops):
    vocab = runtime.model.config.vocab_size
    first = _tokens(1, 50, vocab)
    results = {}
    for on in (True, False):  # one loop at a time: they share the model
        loop = loops(on)
        (out1, u1), = _run(loop, [first])
        second = first + out1 + _tokens(2, 21, vocab)  # the conversation so far, resent, and a new message
        (out2, u2), = _run(loop, [second])
        results[on] = (out1, out2)
        assert u1.cached_tokens == 0
        if on:
            # the first turn's K/V: its prompt and 5 of its 6 tokens (the last was sampled, never fed)
            assert u2.cached_tokens == (len(first) + len(out1) - 1) // BS * BS == 48
            figures = loop.kv_figures()
            assert figures.cached_tokens == 48 and figures.prompt_tokens == len(first) + len(second)
        else:
            assert u2.cached_tokens == 0 and loop.kv_figures().cached_blocks == 0
        loop.stop()
    assert results[True] == results[False]


def test_a_resumed_sequence_computes_the_logits_of_a_fresh_prefill(runtime):
    """Model level: K/V of a shared prefix written by one sequence, read by another that feeds only its suffix."""
    model = runtime.model
    vocab = model.config.vocab_size
    pool = model.new_pool(16, BS)
    prompt = _tokens(5, 70, vocab)
    # sequence A writes 40 tokens into blocks 0, 1, 2 (in two chunks, as the engine would)
    model.forward(ForwardBatch.from_token_lists([prompt[:24]], [0], [0], [[0, 1]]), pool)
    model.forward(ForwardBatch.from_token_lists([prompt[24:40]], [24], [0], [[0, 1, 2]]), pool)
    # sequence B reuses A's first two blocks (32 tokens) and prefills the rest into its own
    resumed = model.forward(ForwardBatch.from_token_lists([prompt[32:]], [32], [1], [[0, 1, 5, 6, 7]]), pool,
                            last_only=False)
    fresh = model.forward(ForwardBatch.from_token_lists([prompt], [0], [2], [[8, 9, 10, 11, 12]]), pool,
                          last_only=False)[:, 32:]
    span = float(fresh.max() - fresh.min())
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-4 * span)
    assert torch.equal(resumed.argmax(-1), fresh.argmax(-1))


def test_eight_sessions_on_one_system_prompt_share_its_blocks(runtime, loops):
    vocab = runtime.model.config.vocab_size
    system = _tokens(7, 64, vocab)
    loop = loops(True, max_batch=8)
    _run(loop, [system + _tokens(8, 5, vocab)], max_tokens=1)  # the system prompt is now cached
    results = _run(loop, [system + _tokens(10 + i, 9, vocab) for i in range(8)], max_tokens=3)
    assert [u.cached_tokens for _, u in results] == [64] * 8


def test_eight_admitted_sequences_hold_the_same_prefix_blocks():
    kv = KVManager(num_blocks=64, block_size=BS)
    system = list(range(100, 164))
    kv.admit(0, system + [1, 2, 3])
    kv.ensure(0, 67)
    kv.release(0, system + [1, 2])  # its 4 whole blocks of the system prompt go into the tree
    for seq in range(1, 9):
        assert kv.admit(seq, system + [seq] * 9) == 64
        kv.ensure(seq, 64 + 9)
    tables = [kv.table(seq) for seq in range(1, 9)]
    shared = tables[0][:4]
    assert all(t[:4] == shared for t in tables)
    assert all(kv.allocator.refs(b) == 9 for b in shared)  # 8 sequences + the tree
    assert len({b for t in tables for b in t[4:]}) == 8  # one block of its own each
    assert kv.figures().used_blocks == 4 + 8
    for seq in range(1, 9):
        kv.release(seq, None)
    assert kv.figures().used_blocks == 4 and kv.clear_cache() == 4 and kv.allocator.num_free == 64


def test_eviction_under_pressure_changes_speed_only(runtime, loops):
    """A pool of 4 blocks (one 64-token sequence): every new conversation evicts the last one's prefix."""
    vocab = runtime.model.config.vocab_size
    convs = [_tokens(20 + i, 34, vocab) for i in range(4)]
    results = {}
    for on in (True, False):
        loop = loops(on, max_batch=1, context_length=64)
        outs = []
        for conv in convs:
            (out1, u1), = _run(loop, [conv], max_tokens=4)
            (out2, u2), = _run(loop, [conv + out1 + [5, 6, 7]], max_tokens=4)
            outs.append((out1, out2, u2.cached_tokens))
        results[on] = outs
        figures = loop.kv_figures()
        if on:
            assert all(cached == 32 for _, _, cached in outs)  # each follow-up found its turn
            assert figures.evicted_blocks > 0 and figures.num_blocks == 4
        loop.stop()
    assert [o[:2] for o in results[True]] == [o[:2] for o in results[False]]


def test_sequences_that_outgrow_a_small_pool_are_preempted_and_finish_as_if_alone(runtime, loops):
    """A pool of 4 blocks and 4 sequences admitted with one block each: as they grow, the newest ones are
    preempted and come back later (from the prefix cache), and every output is the one it has alone."""
    vocab = runtime.model.config.vocab_size
    prompts = [_tokens(40 + i, 10, vocab) for i in range(4)]
    loop = loops(True, max_batch=4, context_length=64, kv_tokens=64)
    together = _run(loop, prompts, max_tokens=30)
    figures = loop.kv_figures()
    assert figures.preempted > 0 and figures.num_blocks == 4
    loop.stop()
    alone_loop = loops(False, max_batch=1, context_length=64)
    for prompt, (tokens, usage) in zip(prompts, together):
        (alone, _), = _run(alone_loop, [prompt], max_tokens=30)
        assert tokens == alone and usage.prompt_tokens == 10 and usage.cached_tokens == 0


@pytest.fixture(scope="module", params=["qwen3_next", "deepseek_v4", "nemotron_h", "kimi_linear"])
def hybrid(request, tmp_path_factory):
    """Models whose layers carry a per-sequence state: Qwen3-Next's DeltaNet, Nemotron-H's Mamba-2, Kimi-Linear's KDA, DeepSeek-V4's
    open compression windows (its checkpoints at multiples of 16 here: the block size, a multiple of its ratios 4 and 8)."""
    yield from _tiny_runtime(tmp_path_factory, request.param)


def test_a_hybrid_sequence_resumed_from_a_state_checkpoint_computes_the_logits_of_a_fresh_prefill(hybrid):
    """Model level: K/V blocks and the linear layers' state after 32 tokens, handed to another sequence."""
    model = hybrid.model
    pool = model.new_pool(16, BS, state_slots=3)
    prompt = _tokens(70, 45, model.config.vocab_size)
    model.forward(ForwardBatch.from_token_lists([prompt[:32]], [0], [0], [[0, 1]], [0]), pool)
    for layer, entries in enumerate(pool.states):
        for name, t in entries.items():
            t[1].copy_(t[0])  # the checkpoint, restored into another sequence's slot
    resumed = model.forward(ForwardBatch.from_token_lists([prompt[32:]], [32], [1], [[0, 1, 5]], [1]), pool,
                            last_only=False)
    fresh = model.forward(ForwardBatch.from_token_lists([prompt], [0], [2], [[8, 9, 10]], [2]), pool,
                          last_only=False)[:, 32:]
    span = float(fresh.max() - fresh.min())
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-4 * span)
    assert torch.equal(resumed.argmax(-1), fresh.argmax(-1))


def test_a_hybrid_follow_up_turn_resumes_from_the_checkpoint_of_the_last_prompt(hybrid):
    vocab = hybrid.model.config.vocab_size
    first = _tokens(80, 40, vocab)
    results = {}
    for on in (True, False):
        loop = EngineLoop(hybrid, name="hybrid", context_length=128, prefix_cache=on)
        loop.start()
        try:
            (out1, u1), = _run(loop, [first])
            (out2, u2), = _run(loop, [first + out1 + _tokens(81, 7, vocab)])
            figures = loop.kv_figures()
        finally:
            assert loop.stop(timeout=10)
        results[on] = (out1, out2)
        if on:
            # the first prompt's prefill stopped at 32 tokens (its last whole block) for a state checkpoint
            assert u2.cached_tokens == 32 and figures.checkpoints >= 1 and figures.checkpoint_bytes > 0
        else:
            assert u2.cached_tokens == 0 and figures.checkpoints == 0
    assert results[True] == results[False]


def test_a_hybrid_model_without_room_for_checkpoints_reuses_nothing_and_survives_preemption(hybrid):
    """Checkpoints larger than their budget are not kept (no reuse), and a preempted sequence starts over
    from token 0 with a fresh state; outputs equal the ones alone."""
    vocab = hybrid.model.config.vocab_size
    prompts = [_tokens(60 + i, 20, vocab) for i in range(3)]
    loop = EngineLoop(hybrid, name="hybrid", max_batch=3, context_length=64, kv_tokens=64, checkpoint_bytes=16)
    loop.start()
    try:
        together = _run(loop, prompts, max_tokens=30)
        (again, usage), = _run(loop, [prompts[0] + together[0][0] + [5, 6]], max_tokens=4)
        figures = loop.kv_figures()
        assert usage.cached_tokens == 0 and figures.checkpoints == 0 and figures.preempted > 0
    finally:
        assert loop.stop(timeout=10)
    alone_loop = EngineLoop(hybrid, name="alone", max_batch=1, context_length=64, prefix_cache=False)
    alone_loop.start()
    try:
        for prompt, (tokens, _) in zip(prompts, together):
            (alone, _), = _run(alone_loop, [prompt], max_tokens=30)
            assert tokens == alone
    finally:
        assert alone_loop.stop(timeout=10)


def test_checkpoints_are_kept_within_their_budget_and_go_with_their_evicted_blocks():
    kv = KVManager(num_blocks=8, block_size=BS, checkpoints=True, checkpoint_bytes=100)
    a, b = list(range(100, 132)), list(range(200, 232))
    for seq, tokens in ((0, a), (1, b)):
        assert kv.admit(seq, tokens + [1]) == 0
        kv.ensure(seq, 33)
        assert kv.checkpoint(seq, tokens, f"state-{seq}", 60)
        kv.release(seq, tokens)
    figures = kv.figures()
    assert figures.checkpoints == 1 and figures.checkpoint_bytes == 60  # a's went: 120 > 100
    assert kv.admit(2, a + [7, 8]) == 0  # a's blocks are cached, but without a state they are of no use
    kv.release(2, None)
    assert kv.admit(3, b + [7, 8]) == 32 and kv.take_restore(3) == "state-1" and kv.take_restore(3) is None
    kv.release(3, None)
    kv.admit(4, b + [9])
    assert not kv.checkpoint(4, b, "too big", 101)  # larger than the whole budget: not kept
    kv.release(4, None)
    kv.clear_cache()  # evicting the blocks drops their checkpoint
    assert kv.figures().checkpoints == 0 and kv.checkpoint_bytes == 0 and kv.allocator.num_free == 8


def test_a_hybrid_prompt_edited_after_a_message_end_resumes_from_the_checkpoint_at_that_end(hybrid):
    """Checkpoints are taken at end-of-message tokens too: a follow-up that rewrites the text after the
    first message (as an agent replacing an old tool output) resumes from the block before that end."""
    vocab = hybrid.model.config.vocab_size
    eos = hybrid.model.config.eos_token_ids[0]
    head = _tokens(90, 20, vocab) + [eos]  # a message ending at position 21: checkpoint after 16 tokens
    first, edited = head + _tokens(91, 30, vocab), head + _tokens(92, 33, vocab)
    results = {}
    for on in (True, False):
        loop = EngineLoop(hybrid, name="hybrid", context_length=128, prefix_cache=on)
        loop.start()
        try:
            (out1, _), = _run(loop, [first])
            (out2, u2), = _run(loop, [edited])
            figures = loop.kv_figures()
        finally:
            assert loop.stop(timeout=10)
        results[on] = (out1, out2)
        if on:
            assert u2.cached_tokens == 16 and figures.checkpoints >= 2  # at 16 and at 48 (the prompt's end)
    assert results[True] == results[False]


def test_hybrid_checkpoint_stops_fall_on_message_and_marker_ends_snapped_to_blocks(hybrid):
    class Markers:  # the tokenizer's say: "</think>" is id 7, "</tool_call>" 8, the others absent
        eos_token_ids = ()

        @staticmethod
        def token_to_id(text):
            return {"</think>": 7, "</tool_call>": 8}.get(text)

        def stream_decoder(self, *a):
            raise AssertionError("not used here")

    from moed.engine.runtime import ModelRuntime

    runtime = ModelRuntime(hybrid.loaded, hybrid.model, hybrid.executor, Markers())
    loop = EngineLoop(runtime, name="stops", context_length=256)
    eos = hybrid.model.config.eos_token_ids[0]
    tokens = [20] * 100
    tokens[19], tokens[40], tokens[70] = 7, 8, eos  # ends after positions 20, 41, 71; the prompt's last is 99
    assert loop._checkpoints.stops(0, tokens, 0) == (16, 32, 64, 96)
    assert loop._checkpoints.stops(0, tokens, 32) == (64, 96)  # only the part not cached yet
    assert loop._checkpoints.stops(0, tokens[:10], 0) == ()  # nothing before the first whole block
    loop.stop()


def test_shrinking_the_pool_moves_the_blocks_still_held_and_keeps_their_contents():
    from moed.cache.kv_cache import KVCache

    kv = KVManager(num_blocks=16, block_size=BS)
    cache = KVCache([{"k": (2,)}], 16, BS, torch.float32)
    kv.admit(0, list(range(160)))
    kv.ensure(0, 160)  # blocks 0..9
    kv.admit(1, list(range(1000, 1048)))
    kv.ensure(1, 48)  # blocks 10..12
    kv.release(0, None)
    old_table = list(kv.table(1))
    assert old_table == [10, 11, 12]
    cache.entry(0, "k").copy_(torch.arange(16 * BS * 2, dtype=torch.float32).view(16, BS, 2))
    before = cache.entry(0, "k")[old_table].clone()
    moves = kv.resize(8)
    new = cache.resized(8, moves)
    table = kv.table(1)
    assert all(b < 8 for b in table) and sorted(moves) == sorted(zip(old_table, table))
    assert torch.equal(new.entry(0, "k")[table], before) and new.num_blocks == 8
    assert kv.allocator.num_free == 8 - 3
    with pytest.raises(Exception, match="cannot shrink"):
        kv.resize(2)
    assert kv.resize(20) == [] and kv.allocator.num_free == 20 - 3


def test_results_are_unchanged_when_the_pool_shrinks_under_cached_prefixes(runtime, loops):
    vocab = runtime.model.config.vocab_size
    first = _tokens(95, 40, vocab)
    results = {}
    for on in (True, False):
        loop = loops(on, max_batch=2, context_length=64)
        (out1, _), = _run(loop, [first])
        assert loop.kv_full_blocks == 8 and loop.kv_floor_blocks() == 4
        assert loop.resize_kv(4).result(timeout=30) == 4  # the cached prefix is evicted or moved
        (out2, _), = _run(loop, [first + out1 + [5, 6]])
        assert loop.resize_kv(100).result(timeout=30) == 8  # back to the configured size, not beyond
        (out3, u3), = _run(loop, [first + out1 + [5, 6]])
        results[on] = (out1, out2, out3)
        if on:
            assert u3.cached_tokens > 0  # the grown pool caches again
        loop.stop()
    assert results[True] == results[False]


class _FailsAfterAPreemption:
    """The tiny model, except that the first forward right after a preemption raises (a failed step)."""

    def __init__(self, model) -> None:
        self._model, self.loop, self.failed_batch = model, None, None
        self._seen: set[int] = set()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, batch, cache):
        new = set(self.loop._preempted) - self._seen  # noqa: SLF001 - the loop's own record
        self._seen |= new
        if new and self.failed_batch is None:
            self.failed_batch = set(batch.slots)  # with block tables the rows are keyed by sequence id
            raise RuntimeError("injected step failure")
        return self._model.forward(batch, cache)


def test_a_failed_step_fails_only_the_sequences_in_it_not_the_one_just_preempted(runtime, loops):
    """A sequence preempted while the step was being put together was not in the failed forward: it goes
    back to the queue and finishes normally; only the sequences of the failed step end with an error."""
    from moed.engine.runtime import ModelRuntime

    vocab = runtime.model.config.vocab_size
    prompts = [_tokens(40 + i, 10, vocab) for i in range(4)]
    failing = _FailsAfterAPreemption(runtime.model)
    rt = ModelRuntime(runtime.loaded, failing, runtime.executor, runtime.tokenizer)
    loop = EngineLoop(rt, name="tiny", prefix_cache=True, max_batch=4, context_length=64, kv_tokens=64)
    failing.loop = loop
    loop.start()
    try:
        handles = [loop.submit(GenerationRequest(f"f{i}", p, SamplingParams(temperature=0.0, max_tokens=30,
                                                                            ignore_eos=True)))
                   for i, p in enumerate(prompts)]
        finished = []
        for h in handles:
            events = list(h.events(timeout=120))
            finished.append((events[-1].finish_reason, [t for e in events for t in e.token_ids]))
    finally:
        assert loop.stop(timeout=10)
    assert failing.failed_batch, "no step ran right after a preemption"
    alone_loop = loops(False, max_batch=1, context_length=64)
    for seq, (prompt, (reason, tokens)) in enumerate(zip(prompts, finished)):
        if seq in failing.failed_batch:
            assert reason == "error"
        else:
            assert reason == "length", (seq, reason, failing.failed_batch)
            (alone, _), = _run(alone_loop, [prompt], max_tokens=30)
            assert tokens == alone


def test_blocks_a_running_hybrid_sequence_checkpointed_are_not_counted_as_room():
    """A checkpoint puts a running sequence's blocks into the tree; evicting them would free nothing (the
    sequence still holds them), so admission must not count them as room for another prompt."""
    kv = KVManager(num_blocks=4, block_size=BS, checkpoints=True)
    tokens = list(range(100, 164))  # 64 tokens: the whole pool
    assert kv.admit(0, tokens) == 0
    kv.ensure(0, 64)
    assert kv.checkpoint(0, tokens[:32], "state", 10)
    assert kv.tree.evictable_blocks() == 0 == kv.tree.count_evictable_blocks()
    assert kv.admit(1, list(range(300, 320))) is None  # no room: wait, rather than be admitted into a full pool
    kv.release(0, None)
    assert kv.tree.evictable_blocks() == 2 == kv.tree.count_evictable_blocks()  # now they are a cached prefix
    assert kv.admit(1, list(range(300, 320))) == 0


def test_the_maintained_evictable_count_matches_the_tree_through_random_sessions():
    import random

    rng = random.Random(7)
    for checkpoints in (False, True):
        kv = KVManager(num_blocks=24, block_size=BS, checkpoints=checkpoints)
        running: dict[int, list[int]] = {}
        stems = [list(range(1000 * k, 1000 * k + 48)) for k in range(3)]
        for step in range(400):
            op = rng.random()
            if op < 0.35 and len(running) < 4:
                seq = step
                prompt = rng.choice(stems)[: rng.choice((16, 20, 32, 48))] + [rng.randrange(50000, 60000)
                                                                            for _ in range(rng.randrange(1, 20))]
                if kv.admit(seq, prompt, alone=not running) is not None:
                    running[seq] = prompt
            elif op < 0.6 and running:
                seq = rng.choice(list(running))
                tokens = running[seq] = running[seq] + [rng.randrange(60000, 70000) for _ in range(rng.randrange(1, 9))]
                try:
                    kv.ensure(seq, len(tokens))
                except Exception:
                    kv.release(seq, None)
                    del running[seq]
                    continue
                full = len(tokens) // BS * BS
                if full and checkpoints:
                    kv.checkpoint(seq, tokens[:full], "s", 1)
                elif full:
                    kv.publish(seq, tokens)
            elif op < 0.85 and running:
                seq = rng.choice(list(running))
                tokens = running.pop(seq)
                kv.release(seq, tokens if rng.random() < 0.8 else None)
            elif op < 0.95:
                kv.tree.evict(rng.randrange(1, 6))
            else:
                try:
                    kv.resize(rng.choice((16, 20, 24, 28)))
                except Exception:
                    pass
            assert kv.tree.evictable_blocks() == kv.tree.count_evictable_blocks(), step
            # every evictable block goes back to the pool when evicted: nobody else holds it
            held = {b for s in running for b in kv.table(s)}
            stack = [kv.tree.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.lock_ref == 0:
                    assert not held & set(node.blocks), step


_SHRINK_SCRIPT = r"""
import json, sys, torch
from moed.cache.kv_cache import KVCache

def rss_and_peak():
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(status["VmRSS"].split()[0]) << 10, int(status["VmHWM"].split()[0]) << 10

entry_mib, blocks, bs = 128, 64, 16
per_token = (entry_mib << 20) // (blocks * bs * 4)
cache = KVCache([{"k": (per_token,), "v": (per_token,)} for _ in range(3)], blocks, bs, torch.float32)
for entries in cache.layers:
    for name in entries:
        entries[name].fill_(1.0)  # every page touched
cache.entry(2, "v")[40] = 7.0
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
before, _ = rss_and_peak()
resized = cache.resized(32, [(40, 3)])
_, peak = rss_and_peak()
ok = (resized is cache and cache.num_blocks == 32 and cache.nbytes() == 6 * (entry_mib << 19)
      and bool(torch.all(cache.entry(2, "v")[3] == 7.0)) and bool(torch.all(cache.entry(0, "k") == 1.0)))
cache.resized(48, [])
ok = ok and cache.entry(2, "v").shape[0] == 48 and bool(torch.all(cache.entry(2, "v")[3] == 7.0))
print(json.dumps({"ok": ok, "rise_mib": (peak - before) >> 20, "entry_mib": entry_mib}))
"""


def test_a_shrinking_pool_never_holds_two_pools():
    """Resizing copies one entry at a time and lets the old one go first: the process's peak RSS during a
    shrink of a 768 MiB pool to half rises by about one new entry (64 MiB), not by the new pool (384 MiB).
    Measured in a fresh interpreter: the entries (128 MiB) are above glibc's largest mmap threshold, so
    each is its own mapping and goes back to the OS when freed, and no other test's heap is in the way."""
    import json
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs here (Linux only): the peak RSS cannot be reset")
    out = subprocess.run([sys.executable, "-c", _SHRINK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"], result
    assert result["rise_mib"] < 5 * result["entry_mib"] // 4, result  # not the new pool's 384 MiB
