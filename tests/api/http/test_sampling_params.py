"""OpenAI's sampling parameters reach the sampler (issue #34): ``logit_bias`` forces and bans tokens, presence and
frequency penalties change a greedy answer that repeats itself, and malformed values are 400s naming the field.
The formulas themselves are checked against plain references in tests/engine/test_sampling.py."""

from __future__ import annotations

import openai
import pytest


def test_logit_bias_forces_and_bans_tokens(daemon, client):
    tokenizer = next(iter(daemon.manager._models.values())).runtime.tokenizer  # noqa: SLF001
    x = tokenizer.encode("x")[0]
    done = client.completions.create(model="tiny", prompt="Say:", max_tokens=6, temperature=0,
                                     logit_bias={str(x): 100})
    assert done.choices[0].text == "x" * 6
    free = client.completions.create(model="tiny", prompt="Say:", max_tokens=6, temperature=0)
    first = tokenizer.encode(free.choices[0].text)[0]
    banned = client.completions.create(model="tiny", prompt="Say:", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[0] != first
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(x): 100})
    assert chat.choices[0].message.content == "x" * 4


def test_presence_and_frequency_penalties_change_a_repeating_answer(client):
    plain = client.completions.create(model="tiny", prompt="The", max_tokens=40, temperature=0).choices[0].text
    for field in ("presence_penalty", "frequency_penalty"):
        other = client.completions.create(model="tiny", prompt="The", max_tokens=40, temperature=0,
                                          **{field: 2.0}).choices[0].text
        assert other != plain, field


@pytest.mark.parametrize("extra, param", [({"logit_bias": {"abc": 5}}, "logit_bias"),
                                          ({"logit_bias": {"5": 250}}, "logit_bias"),
                                          ({"presence_penalty": 3}, "presence_penalty")])
def test_bad_values_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=extra)
    assert param in str(err.value)
