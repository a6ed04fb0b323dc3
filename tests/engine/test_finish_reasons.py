"""Every way a request ends, on the engine loop, against outputs written in the test.

The model is a ScriptedModel: it knows a few token sequences (encoded from the texts below) and
always predicts the next token of the sequence its prompt starts. So what each request should
produce (tokens, text, finish reason, usage) follows from the script and the request alone.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from helpers.scripted_model import ScriptedModel, scripted_runtime
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.engine_loop import EngineLoop
from moed.engine.offline_run import run_offline
from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams
from moed.text.tokenizer import Tokenizer

EOS = 3  # "<|im_end|>" in the tiny tokenizer
P = 4  # prompt tokens: every prompt is the first P tokens of its script
TEXTS = ("The router reads the weights quickly and the daemon streams many bytes again, then the scheduler "
         "keeps every request.",
         "Zebras quietly migrate across Kenya's savanna; penguins waddle home.",
         "Every token routes twelve experts, overlapping PCIe copies with CPU work.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def seqs(tokenizer) -> list[list[int]]:
    out = [tokenizer.encode(t) for t in TEXTS]
    assert len({s[0] for s in out}) == len(out), "scripts are keyed by their first token"
    assert all(len(s) > P + 12 for s in out)
    return out


def make_model(seqs, **kwargs) -> ScriptedModel:
    return ScriptedModel({s[0]: s for s in seqs}, vocab_size=512, eos_token_ids=(EOS,), **kwargs)


def run_one(model, tokenizer, prompt, params, *, context=128, deadline=None, on_loop=None):
    """Submit one request on a fresh loop; returns (tokens, text, deltas, done event, loop)."""
    loop = EngineLoop(scripted_runtime(model, tokenizer), name="scripted", max_batch=2, context_length=context)
    handle = loop.submit(GenerationRequest("r", list(prompt), params, deadline=deadline))
    loop.start()
    try:
        events = handle.events(timeout=30)
        seen = []
        for event in events:
            seen.append(event)
            if on_loop is not None and on_loop(loop, handle, seen):
                on_loop = None
        done = seen[-1]
        assert done.done and not any(e.done for e in seen[:-1])
        tokens = [t for e in seen for t in e.token_ids]
        deltas = [e.text for e in seen]
        return tokens, "".join(deltas), deltas, done, loop
    finally:
        assert loop.stop(timeout=10)


def test_max_tokens_ends_with_length_and_the_loop_feeds_back_what_it_sampled(seqs, tokenizer):
    model = make_model(seqs)
    seq = seqs[0]
    tokens, text, _, done, loop = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=5))
    assert tokens == seq[P:P + 5]
    assert text == tokenizer.decode(seq[P:P + 5])
    assert done.finish_reason == "length"
    assert done.usage.prompt_tokens == P and done.usage.completion_tokens == 5
    # positions 0..P+3 were fed: the prompt, then each sampled token but the last
    assert model.fed() == seq[:P + 4]


def test_eos_ends_the_request_and_is_counted_but_not_printed(seqs, tokenizer):
    seq = seqs[1][:P + 3] + [EOS] + seqs[1][P + 3:]
    model = make_model([seq])
    tokens, text, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=50))
    assert tokens == seq[P:P + 4] and tokens[-1] == EOS
    assert text == tokenizer.decode(seq[P:P + 3])
    assert done.finish_reason == "eos" and done.usage.completion_tokens == 4


def test_ignore_eos_generates_past_it(seqs, tokenizer):
    seq = seqs[1][:P + 3] + [EOS] + seqs[1][P + 3:]
    model = make_model([seq])
    tokens, _, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=7, ignore_eos=True))
    assert tokens == seq[P:P + 7] and EOS in tokens
    assert done.finish_reason == "length"


def _piece_texts(tokenizer, seq) -> list[str]:
    """The text each generated token adds (ASCII scripts: one token never splits a character)."""
    return [tokenizer.decode(seq[: i + 1])[len(tokenizer.decode(seq[:i])):] for i in range(P, len(seq))]


def test_a_stop_string_spanning_three_tokens_cuts_the_text_and_is_never_streamed(seqs, tokenizer):
    seq = seqs[0]
    pieces = _piece_texts(tokenizer, seq)
    # a stop string that starts inside piece j, covers piece j+1 and ends inside piece j+2
    j = next(i for i in range(2, len(pieces) - 3)
             if len(pieces[i]) >= 2 and len(pieces[i + 2]) >= 2 and pieces[i + 1].strip())
    stop = pieces[j][-1] + pieces[j + 1] + pieces[j + 2][0]
    full = "".join(pieces)
    assert full.index(stop) == len("".join(pieces[: j + 1])) - 1, "the stop string must first occur there"
    model = make_model(seqs)
    tokens, text, deltas, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=40, stop=(stop,)))
    assert done.finish_reason == "stop"
    assert text == "".join(pieces[:j]) + pieces[j][:-1]
    assert tokens == seq[P:P + j + 3], "generation ends at the token that completes the stop string"
    assert not any(stop[:2] in d for d in deltas), "no part of the stop string reached the client"


def test_a_held_back_possible_stop_is_released_when_the_request_ends_otherwise(seqs, tokenizer):
    seq = seqs[2]
    pieces = _piece_texts(tokenizer, seq)
    n = 6
    generated = "".join(pieces[:n])
    stop = generated[-1] + "\x07never"  # its first character ends the output, the rest never comes
    model = make_model(seqs)
    tokens, text, deltas, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=n, stop=(stop,)))
    assert done.finish_reason == "length" and tokens == seq[P:P + n]
    assert text == generated
    assert deltas[-1].endswith(generated[-1]), "the held-back character comes with the done event"


def test_a_full_context_ends_with_context_and_nothing_is_written_past_it(seqs, tokenizer):
    seq = seqs[0]
    context = P + 6
    model = make_model(seqs)
    tokens, _, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=100), context=context)
    assert done.finish_reason == "context"
    assert tokens == seq[P:context], "prompt + generated tokens fill the context exactly"
    assert model.fed() == seq[: context - 1], "the last token is sampled, never fed"


def test_cancel_mid_stream_ends_with_cancelled_after_a_prefix(seqs, tokenizer):
    seq = seqs[0]
    model = make_model(seqs, step_delay_s=0.01)

    def cancel_after_three(loop, handle, seen):
        if len(seen) == 3:
            assert handle.cancel()
            return True
        return False

    tokens, _, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=60), on_loop=cancel_after_three)
    assert done.finish_reason == "cancelled"
    assert 3 <= len(tokens) < 60
    assert tokens == (seq + [0] * 60)[P:P + len(tokens)]


def test_a_deadline_ends_the_request_and_a_past_deadline_generates_nothing(seqs, tokenizer):
    seq = seqs[0]
    model = make_model(seqs, step_delay_s=0.02)
    tokens, _, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=10_000),
                                    deadline=time.monotonic() + 1.0)
    assert done.finish_reason == "deadline"
    assert 0 < len(tokens) < 10_000
    assert tokens == (seq + [0] * 10_000)[P:P + len(tokens)]
    tokens, text, _, done, _ = run_one(model, tokenizer, seq[:P], SamplingParams(max_tokens=5),
                                       deadline=time.monotonic() - 1)
    assert done.finish_reason == "deadline" and tokens == [] and text == ""
    assert done.usage.completion_tokens == 0


def test_a_batch_of_requests_each_follow_their_own_script(seqs, tokenizer):
    model = make_model(seqs)
    n = [7, 3, 11]
    out = run_offline(scripted_runtime(model, tokenizer), [s[:P] for s in seqs],
                      [SamplingParams(max_tokens=k) for k in n])
    assert model.num_forwards == max(n), "all three were in every step until each finished"
    for seq, k, c in zip(seqs, n, out):
        assert c.token_ids == seq[P:P + k]
        assert c.text == tokenizer.decode(seq[P:P + k])
        assert c.finish_reason == "length"


def test_offline_runs_size_the_context_to_a_long_prompt(seqs, tokenizer, monkeypatch):
    """`moed generate` without --context: a prompt longer than the default context still runs (the
    context grows to the prompt plus max_tokens, capped at the model's maximum) and is cut by its length."""
    from moed.engine import engine_loop, offline_run

    monkeypatch.setattr(offline_run, "DEFAULT_CONTEXT", 8)
    monkeypatch.setattr(engine_loop, "DEFAULT_CONTEXT", 8)  # what the loop alone would serve
    model = make_model(seqs)
    prompt = seqs[0][:P + 6]  # longer than the default of 8
    runtime = scripted_runtime(model, tokenizer)
    (done,) = run_offline(runtime, [prompt], [SamplingParams(max_tokens=3)])
    assert done.finish_reason == "length" and done.token_ids == seqs[0][P + 6:P + 9]
    model.config = dataclasses.replace(model.config, max_position_embeddings=len(prompt) + 2)
    (done,) = run_offline(runtime, [prompt], [SamplingParams(max_tokens=3)])
    assert done.finish_reason == "context" and done.token_ids == seqs[0][P + 6:P + 8]

