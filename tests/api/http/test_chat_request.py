"""The chat request rules every API shares: system messages after the start folded into user turns."""

from __future__ import annotations

from moed.api.http.chat_request import fold_system_messages
from moed.text.generic_tools import generic_messages


def test_leading_system_messages_join_and_later_ones_fold_into_the_nearest_user_turn():
    out = fold_system_messages([
        {"role": "system", "content": "A"}, {"role": "system", "content": "B"},
        {"role": "user", "content": "hi"}, {"role": "system", "content": "after hi"},
        {"role": "assistant", "content": "ok"}, {"role": "system", "content": "before next"},
        {"role": "user", "content": "next"}])
    assert out == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi\n\nafter hi"},
                   {"role": "assistant", "content": "ok"}, {"role": "user", "content": "before next\n\nnext"}]
    # a system message that ends the conversation becomes a user turn of its own
    assert fold_system_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                 {"role": "system", "content": "s"}])[-1] == {"role": "user", "content": "s"}


def test_the_generic_format_writes_calls_and_results_as_text_and_merges_adjacent_results():
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a"}'}}
    out = generic_messages([{"role": "user", "content": "go"},
                            {"role": "assistant", "content": "", "tool_calls": [call, call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "one"},
                            {"role": "tool", "tool_call_id": "c1", "content": "two"},
                            {"role": "user", "content": "and?"}], [])
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"].count('<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>') == 2
    assert out[2]["content"] == "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>\n\nand?"
