"""Log-probabilities (issue #34): chat ``logprobs`` / ``top_logprobs`` and completions ``logprobs: N``, whole and
streamed, equal the log-softmax of the model's own logits for each step (recomputed here with a plain forward
pass), and follow logit_bias (what the sampler sees is what is reported)."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from moed.runner.forward_batch import ForwardBatch

PROMPT = [5, 60, 61, 62, 63, 64]  # token ids: no template, no special tokens in doubt


def _entry(daemon):
    return daemon.manager._models["tiny"]  # noqa: SLF001 - the served model, to recompute its logits


def _reference(daemon, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits after ``ids``, from a fresh forward pass."""
    model = _entry(daemon).runtime.model
    logits = model.forward(ForwardBatch.from_token_lists([ids], [0], [0]), model.new_cache(1, 64))
    return torch.log_softmax(logits[0].float(), dim=-1)


def test_completion_logprobs_are_the_models_log_softmax(daemon, client):
    tokenizer = _entry(daemon).runtime.tokenizer
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    ids = list(PROMPT)
    for i in range(6):
        ref = _reference(daemon, ids)
        chosen = int(ref.argmax())  # greedy
        assert lp.tokens[i] == tokenizer.decode([chosen], skip_special_tokens=False)
        assert abs(lp.token_logprobs[i] - float(ref[chosen])) < 1e-4
        top = torch.topk(ref, 5)
        want = {tokenizer.decode([t], skip_special_tokens=False): float(v) for t, v in zip(top.indices, top.values)}
        assert set(lp.top_logprobs[i]) == set(want)
        assert all(abs(lp.top_logprobs[i][k] - want[k]) < 1e-4 for k in want)
        ids.append(chosen)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_whole_and_streamed_agree_and_sum_to_one(client):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
               logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    assert len(whole) == 5 and all(len(t.top_logprobs) == 4 for t in whole)
    for t in whole:
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)  # greedy: the top one
        assert bytes(t.bytes).decode(errors="replace") == t.token or "\ufffd" in t.token
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1.0 + 1e-5
    streamed = [e for c in client.chat.completions.create(**ask, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in whole]


def test_logprobs_follow_logit_bias(daemon, client):
    tokenizer = _entry(daemon).runtime.tokenizer
    x = tokenizer.encode("x")[0]
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                     logit_bias={str(x): 100})
    assert done.choices[0].logprobs.tokens == ["x", "x"]
    assert done.choices[0].logprobs.token_logprobs[0] > -1e-3  # +100 on a logit: nearly all the mass


@pytest.mark.parametrize("extra, param", [({"logprobs": 6}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs")])
def test_bad_logprobs_requests_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        if "top_logprobs" in extra:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=extra)
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=extra)
    assert param in str(err.value)


def test_responses_logprobs_with_include(client):
    ask = dict(model="tiny", input="hi", max_output_tokens=5, temperature=0, top_logprobs=3,
               include=["message.output_text.logprobs"])
    done = client.responses.create(**ask)
    part = done.output[-1].content[0]
    assert len(part.logprobs) == 5 and all(len(t.top_logprobs) == 3 for t in part.logprobs)
    assert b"".join(bytes(t.bytes) for t in part.logprobs).decode(errors="replace") == part.text  # exact bytes
    streamed = [e for e in client.responses.create(**ask, stream=True) if e.type == "response.output_text.done"]
    assert [round(t.logprob, 5) for t in streamed[0].logprobs] == [round(t.logprob, 5) for t in part.logprobs]
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=5, temperature=0)
    assert plain.output[-1].content[0].logprobs == []
