"""Sampling: parity with transformers' logits processors, seeding, distribution sanity, validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moed.engine.sampling import (
    MAX_STOP_STRINGS,
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    sample_batch,
)
from moed.errors import InvalidRequestError

V = 97


def _logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


def _hf(proc: Any, logits: torch.Tensor, ids: list[int] | None = None) -> torch.Tensor:
    input_ids = torch.tensor([ids or [0]], dtype=torch.long)
    return proc(input_ids, logits.clone()[None])[0]


def _assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # Same surviving tokens, same resulting distribution.
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), rtol=1e-5, atol=1e-7)


PREV = [3, 3, 10, 50, 96, 0, 10]


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches(penalty: float) -> None:
    for seed in range(5):
        x = _logits(seed)
        ours = apply_repetition_penalty(x, PREV, penalty)
        ref = _hf(RepetitionPenaltyLogitsProcessor(penalty), x, PREV)
        torch.testing.assert_close(ours, ref)
    # Ids beyond the logits (padded embedding rows) are ignored, not an error.
    apply_repetition_penalty(_logits(0), [V + 5, 1], 1.5)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches(temperature: float) -> None:
    x = _logits(1)
    params = SamplingParams(temperature=temperature)
    _assert_same(Sampler(params).process(x, []), _hf(TemperatureLogitsWarper(temperature), x))


@pytest.mark.parametrize("k", [1, 2, 5, 40, V, V + 10])
def test_top_k_matches(k: int) -> None:
    for seed in range(5):
        x = _logits(seed)
        _assert_same(apply_top_k(x, k), _hf(TopKLogitsWarper(k), x))
    ties = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.5])  # tied with the k-th: all kept, as in transformers
    assert torch.isfinite(apply_top_k(ties, 2)).sum() == 3


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.999])
def test_top_p_matches(p: float) -> None:
    for seed in range(5):
        x = _logits(seed)
        _assert_same(apply_top_p(x, p), _hf(TopPLogitsWarper(p), x))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches(min_p: float) -> None:
    for seed in range(5):
        x = _logits(seed)
        _assert_same(apply_min_p(x, min_p), _hf(MinPLogitsWarper(min_p), x))


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2},
        {"temperature": 1.5, "top_k": 0, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0},
        {"temperature": 0.5, "top_k": 3, "top_p": 1.0, "min_p": 0.2, "repetition_penalty": 0.8},
    ],
)
def test_full_pipeline_matches_generate_order(kw: dict[str, Any]) -> None:
    # The same order transformers' generate() builds: penalty processor, then T, top-k, top-p, min-p warpers.
    procs = LogitsProcessorList()
    if kw["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
    procs.append(TemperatureLogitsWarper(kw["temperature"]))
    if kw["top_k"]:
        procs.append(TopKLogitsWarper(kw["top_k"]))
    if kw["top_p"] < 1.0:
        procs.append(TopPLogitsWarper(kw["top_p"]))
    procs.append(MinPLogitsWarper(kw["min_p"]))
    sampler = Sampler(SamplingParams(**kw))
    for seed in range(5):
        x = _logits(seed)
        _assert_same(sampler.process(x, PREV), _hf(procs, x, PREV))


def test_greedy_is_argmax_after_penalty() -> None:
    x = torch.zeros(V)
    x[7], x[8] = 5.0, 4.0
    assert Sampler(SamplingParams()).sample(x, []) == 7
    # 5 / 1.5 < 4: the penalty moves the argmax to a token not seen before.
    assert Sampler(SamplingParams(repetition_penalty=1.5)).sample(x, [7]) == 8
    # Greedy ignores sampling warpers and the RNG entirely.
    s = Sampler(SamplingParams(top_k=3, top_p=0.5, seed=1))
    assert [s.sample(x, []) for _ in range(5)] == [7] * 5


def test_seed_reproducible_and_independent() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    x = _logits(3, scale=1.0)
    a, b = Sampler(params), Sampler(params)
    other = Sampler(SamplingParams(temperature=1.0, seed=99))
    seq_a = [a.sample(x, []) for _ in range(60)]
    # Interleave another request (as in a batch): b's sequence must not change.
    seq_b = []
    for _ in range(60):
        other.sample(x, [])
        seq_b.append(b.sample(x, []))
    assert seq_a == seq_b
    assert len(set(seq_a)) > 5  # actually random
    seq_c = [Sampler(SamplingParams(temperature=1.0, seed=99)).sample(x, []) for _ in range(1)]
    assert [Sampler(SamplingParams(temperature=1.0, seed=1235)).sample(x, []) for _ in range(60)] != seq_a
    assert seq_c == [Sampler(SamplingParams(temperature=1.0, seed=99)).sample(x, [])]
    # The largest allowed seed works too.
    Sampler(SamplingParams(temperature=1.0, seed=2**64 - 1)).sample(x, [])


def test_unseeded_samplers_draw_their_own_seed() -> None:
    s1, s2 = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert s1.seed != s2.seed
    replay = Sampler(SamplingParams(temperature=1.0, seed=s1.seed))
    x = _logits(5, scale=1.0)
    assert [s1.sample(x, []) for _ in range(20)] == [replay.sample(x, []) for _ in range(20)]


def test_top_k_2_only_top_two_appear() -> None:
    x = _logits(11, scale=0.5)
    top2 = set(torch.topk(x, 2).indices.tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    seen = {s.sample(x, []) for _ in range(200)}
    assert seen == top2


def test_sampling_frequencies_follow_probabilities() -> None:
    x = torch.full((V,), -math.inf)
    x[:3] = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = torch.bincount(torch.tensor([s.sample(x, []) for _ in range(2000)]), minlength=V)
    freq = counts[:3].float() / 2000
    assert counts[3:].sum() == 0
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04, rtol=0)


def test_top_p_and_min_p_restrict_support() -> None:
    x = torch.full((V,), -10.0)
    x[:4] = torch.tensor([3.0, 2.5, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=3))
    assert {s.sample(x, []) for _ in range(200)} <= {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=3))
    assert {s.sample(x, []) for _ in range(200)} == {0, 1}


def test_sample_batch_uses_each_requests_rng() -> None:
    logits = torch.stack([_logits(1, 1.0), _logits(2, 1.0)])
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.9, top_k=10, seed=6)]
    batch = [Sampler(p) for p in params]
    solo = [Sampler(p) for p in params]
    for _ in range(10):
        got = sample_batch(batch, logits, [[1, 2], [3]])
        assert got == [solo[0].sample(logits[0], [1, 2]), solo[1].sample(logits[1], [3])]
    with pytest.raises(ValueError, match="sample_batch"):
        sample_batch(batch, logits[0], [[1], [2]])


def test_accepts_tensor_previous_ids_and_half_logits() -> None:
    s = Sampler(SamplingParams(repetition_penalty=1.3))
    x = _logits(4)
    assert s.sample(x.half(), torch.tensor(PREV)) == s.sample(x, PREV)


def test_params_defaults_and_stop_coercion() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.0, 0, 1.0, 0.0, 1.0)
    assert p.greedy and p.max_tokens == 256 and p.stop == () and p.seed is None and not p.ignore_eos
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    hash(SamplingParams(stop=("x",)))
    with pytest.raises(Exception):
        p.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "1"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 3.0),
        ("stop", "END"),
        ("stop", ("",)),
        ("stop", (1,)),
        ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
        ("ignore_eos", "yes"),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("logit_bias", ((5, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", tuple((i, 1.0) for i in range(301))),
    ],
)
def test_invalid_params_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg or (field == "stop" and "stop" in msg)


def test_error_message_gives_allowed_range() -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p=1\.5 is out of range: top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match=r"temperature must be a finite number >= 0; use 0 for greedy"):
        SamplingParams(temperature=-1.0)


def test_boundaries_are_valid() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1e-3, seed=0, max_tokens=1)
    SamplingParams(min_p=1.0, top_p=1e-9, seed=2**64 - 1, stop=tuple("abcdefghijklmnop"))


def _openai_reference(logits: torch.Tensor, generated: list[int], presence: float, frequency: float,
                      bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's documented formula, token by token in plain Python:
    mu[j] -> mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty, then + logit_bias[j]."""
    out = logits.tolist()
    for j in range(len(out)):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence + bias.get(j, 0.0)
    return torch.tensor(out)


@pytest.mark.parametrize("presence, frequency", [(0.0, 0.0), (0.7, 0.0), (0.0, 1.3), (-0.5, 2.0), (2.0, -2.0)])
def test_presence_frequency_and_logit_bias_follow_openais_formula(presence: float, frequency: float) -> None:
    logits = _logits(7)
    generated = [3, 3, 3, 10, 50, 96, 10]
    bias = {3: -100.0, 11: 5.5, 60: 100.0}
    sampler = Sampler(SamplingParams(temperature=1.0, presence_penalty=presence, frequency_penalty=frequency,
                                     logit_bias=tuple(bias.items())))
    got = sampler.penalized(logits, [1, 2] + generated, generated)
    torch.testing.assert_close(got, _openai_reference(logits, generated, presence, frequency, bias))
    # the prompt does not count: the same ids in the prompt only change nothing
    assert torch.equal(sampler.penalized(logits, [3, 10, 50], []), _openai_reference(logits, [], 0.0, 0.0, bias))
    # and the sampled distribution is the softmax of those logits
    torch.testing.assert_close(sampler.process(logits, [], generated).softmax(-1), got.softmax(-1))


def test_logit_bias_of_minus_100_bans_and_plus_100_forces_greedy() -> None:
    logits = _logits(8)
    top = int(logits.argmax())
    banned = Sampler(SamplingParams(logit_bias=((top, -100.0),)))
    assert banned.sample(logits, []) != top
    forced = Sampler(SamplingParams(logit_bias=((5, 100.0),)))
    assert forced.sample(logits, []) == 5
