"""Ragged (packed) steps: the sequences of a step back to back in one row, no padding.

A packed step must give every sequence the logits the padded step gives it (same caches, same
states), for every attention kind: grouped MHA with sinks and a sliding window (gpt-oss), MLA with
its absorbed decode and expanded prefill in one step (DeepSeek-V3), and a hybrid with recurrent
states (Qwen3-Next). The engine packs every step whose chunks differ in length: no place of a step
is padding.
"""

from __future__ import annotations

import pytest
import torch

from moed.runner.forward_batch import ForwardBatch

pytest.importorskip("transformers")

BS = 16


def test_a_packed_batch_places_each_sequence_back_to_back():
    batch = ForwardBatch.from_token_lists([[5, 6, 7], [8], [9, 10]], [0, 40, 3], [11, 12, 13], packed=True)
    assert batch.packed and tuple(batch.input_ids.shape) == (1, 6) and batch.all_valid
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.positions[0].tolist() == [0, 1, 2, 40, 3, 4]
    assert [batch.segment(i) for i in range(3)] == [(0, 0, 0, 3), (0, 3, 40, 1), (0, 4, 3, 2)]
    assert batch.token_sequences() == [0, 0, 0, 1, 2, 2]
    assert batch.last_places() == ([0, 0, 0], [2, 3, 5])
    assert batch.num_keys == 41
    # equal lengths have nothing to save: the padded layout (a decode step stays [B, 1] for the native kernels)
    same = ForwardBatch.from_token_lists([[1], [2]], [4, 9], [0, 1], packed=True)
    assert not same.packed and tuple(same.input_ids.shape) == (2, 1)
    padded = ForwardBatch.from_token_lists([[5, 6, 7], [8]], [0, 40], [0, 1])
    assert not padded.packed and not padded.all_valid and padded.last_places() == ([0, 1], [2, 0])


def test_packed_sequences_may_not_overlap_or_spill():
    ids = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="overlap"):
        ForwardBatch(ids, [0, 0], [3, 2], [0, 1], rows=[0, 0], offsets=[0, 2])
    with pytest.raises(ValueError, match="fit"):
        ForwardBatch(ids, [0], [3], [0], rows=[0], offsets=[2])
    with pytest.raises(ValueError, match="offset"):
        ForwardBatch(ids, [0], [3], [0], rows=[0])


def _steps(vocab: int) -> list[list[tuple[int, list[int]]]]:
    """Three steps of four sequences (sequence id, new tokens): prefills of different lengths, then decode
    rows sharing a step with prefill chunks (some of them beyond gpt-oss's 16-token window)."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        [(0, tok(21)), (1, tok(5)), (2, tok(1))],
        [(0, tok(1)), (1, tok(30)), (2, tok(1)), (3, tok(12))],
        [(0, tok(1)), (1, tok(1)), (2, tok(9)), (3, tok(1))],
    ]


def _run(model, steps, packed: bool) -> list[torch.Tensor]:
    cache = model.new_pool(64, BS, state_slots=4)
    tables = {s: list(range(s * 16, s * 16 + 16))[::-1] for s in range(4)}  # scattered, non-contiguous blocks
    done = {s: 0 for s in range(4)}
    out = []
    for step in steps:
        batch = ForwardBatch.from_token_lists([t for _, t in step], [done[s] for s, _ in step], [s for s, _ in step],
                                              [tables[s] for s, _ in step], [s for s, _ in step], packed=packed)
        assert batch.packed == packed
        for s, t in step:
            done[s] += len(t)
        out.append(model.forward(batch, cache))
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_next"])
def test_a_packed_step_gives_each_sequence_the_padded_steps_logits(tmp_path, family):
    from helpers.tiny_models import build_tiny_model
    from moed.engine.runtime import open_runtime

    build_tiny_model(family, tmp_path)
    runtime = open_runtime(tmp_path)
    try:
        steps = _steps(runtime.model.config.vocab_size)
        padded, packed = _run(runtime.model, steps, False), _run(runtime.model, steps, True)
    finally:
        runtime.close()
    for a, b in zip(padded, packed):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * float(a.abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_engine_pays_for_tokens_not_padding(tmp_path):
    """A decode row that shares a step with a prefill chunk costs one place of the step, not the chunk's length:
    every step the engine runs has exactly as many places as new tokens (this failed with padded steps)."""
    from helpers.tiny_models import build_tiny_model
    from moed.config import EngineConfig
    from moed.engine.engine_loop import EngineLoop
    from moed.engine.request import GenerationRequest
    from moed.engine.runtime import open_runtime
    from moed.engine.sampling import SamplingParams

    build_tiny_model("qwen3_moe", tmp_path)
    runtime = open_runtime(tmp_path, engine=EngineConfig(device="cpu"))
    seen: list[tuple[int, int, int]] = []  # (places, new tokens, sequences) per step
    forward = runtime.model.forward

    def counting(batch, cache, **kw):
        seen.append((batch.input_ids.numel(), sum(batch.lengths), len(batch.lengths)))
        return forward(batch, cache, **kw)

    runtime.model.forward = counting
    loop = EngineLoop(runtime, name="ragged", max_batch=4, prefill_chunk=32)
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        first = loop.submit(GenerationRequest("decoding", list(range(3, 20)), params))
        events = first.events(timeout=120)
        next(events)  # the first request decodes from here on
        second = loop.submit(GenerationRequest("prefilling", list(range(3, 200)), params))
        for handle in (events, second.events(timeout=120)):
            assert [e.finish_reason for e in handle if e.done] == ["length"]
    finally:
        assert loop.stop(timeout=10)
        runtime.close()
    assert all(places == tokens for places, tokens, _ in seen), seen
    assert any(n > 1 and tokens > n for _, tokens, n in seen), f"no step mixed decode and prefill: {seen}"
