"""Routing traces: writer/reader round trip, other tools' field names, and clear errors."""

from __future__ import annotations

import json

import pytest

from moed.errors import InvalidRequestError
from moed.experts.routing_trace import RoutingTraceWriter, read_routing_trace


def write_lines(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def test_round_trip(tmp_path):
    path = tmp_path / "routes.jsonl"
    with RoutingTraceWriter(path) as writer:
        writer.write_step("r1", 0, "prefill", {0: [3, 1], 2: [0, 5]})
        writer.write_step("r1", 1, "prefill", {0: [1, 2], 2: [5, 4]})
        writer.write_step("r1", 2, "decode", {0: [7, 1], 2: [4, 6]})
        # flushed per step: readable before close
        assert len(read_routing_trace(path)) == 6
        writer.write_step(2, 0, "decode", {0: [0, 1]})
    trace = read_routing_trace(path)
    assert trace.num_experts == 8 and trace.layers == [0, 2] and trace.num_layers == 2
    assert list(trace.steps()) == [
        ("r1", 0, "prefill", {0: [3, 1], 2: [0, 5]}),
        ("r1", 1, "prefill", {0: [1, 2], 2: [5, 4]}),
        ("r1", 2, "decode", {0: [7, 1], 2: [4, 6]}),
        (2, 0, "decode", {0: [0, 1]}),
    ]
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"type": "route", "req_id": "r1", "token_pos": 0, "layer": 0, "experts": [3, 1],
                     "phase": "prefill"}


def test_writer_rejects_bad_phase_and_writes_after_close(tmp_path):
    writer = RoutingTraceWriter(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="phase"):
        writer.write("a", 0, 0, [1], phase="generate")
    writer.close()
    writer.close()  # closing twice is fine
    with pytest.raises(ValueError, match="closed"):
        writer.write("a", 0, 0, [1])


def test_alternative_field_names_and_missing_phase(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"problem_id": "p7", "token_idx": 4, "layer": 1, "topk_ids": [2, 9]},
        {"problem_id": "p7", "token_idx": 4, "layer": 3, "topk_ids": [1, 0]},
        {"seq": 3, "token_idx": 4, "layer": 1, "experts": [5, 6]},
        {"token_pos": 5, "layer": 1, "experts": [5, 6]},
    ])
    trace = read_routing_trace(path)
    assert list(trace.steps()) == [
        ("p7", 4, "decode", {1: [2, 9], 3: [1, 0]}),
        (3, 4, "decode", {1: [5, 6]}),  # same position, another sequence: another step
        (None, 5, "decode", {1: [5, 6]}),
    ]


def test_non_route_and_blank_lines_are_ignored(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"type": "meta", "model": "x", "num_experts": 4},
        "",
        {"type": "route", "req_id": 1, "token_pos": 0, "layer": 0, "experts": [1]},
        "   ",
        {"type": "timing", "layer": "not an int"},
    ])
    trace = read_routing_trace(path)
    assert len(trace) == 1 and list(trace.steps()) == [(1, 0, "decode", {0: [1]})]


@pytest.mark.parametrize("bad_line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"token_pos": 1, "experts": [1]}', "missing field 'layer'"),
    ('{"token_pos": 1, "layer": 0}', "missing field 'experts' or 'topk_ids'"),
    ('{"token_pos": 1, "layer": 0, "experts": [1, "2"]}', "list of integers"),
    ('{"token_pos": 1, "layer": "0", "experts": [1]}', "'layer' must be an integer"),
    ('{"layer": 0, "experts": [1]}', "missing field 'token_pos' or 'token_idx'"),
    ('{"token_pos": 1, "layer": 0, "experts": [1], "phase": "warmup"}', "phase must be one of"),
    ('{"token_pos": 1, "layer": 0, "experts": [-1]}', "out of range"),
])
def test_malformed_line_error_names_the_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "t.jsonl", [
        {"token_pos": 0, "layer": 0, "experts": [1]},
        "",
        bad_line,
    ])
    with pytest.raises(InvalidRequestError, match=message) as info:
        read_routing_trace(path)
    assert f"{path}, line 3" in str(info.value)


def test_num_experts_inferred_or_checked(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"token_pos": 0, "layer": 0, "experts": [3, 11]},
        {"token_pos": 0, "layer": 1, "experts": [0, 2]},
    ])
    assert read_routing_trace(path).num_experts == 12
    assert read_routing_trace(path, num_experts=64).num_experts == 64
    with pytest.raises(InvalidRequestError, match=r"line 1: expert ids \[11\] are out of range \(0..7\)"):
        read_routing_trace(path, num_experts=8)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        read_routing_trace(tmp_path / "nope.jsonl")


def test_steps_come_in_execution_order_whatever_the_file_order(tmp_path):
    # layer-major (layer 3 written before layer 1 even), two sequences interleaved, positions
    # out of order; sequence 9 is mentioned first, so it runs first although "a" < 9 is no order
    path = write_lines(tmp_path / "t.jsonl", [
        {"req_id": 9, "token_pos": 1, "layer": 3, "experts": [4], "phase": "decode"},
        {"req_id": "a", "token_pos": 0, "layer": 3, "experts": [5], "phase": "prefill"},
        {"req_id": 9, "token_pos": 0, "layer": 3, "experts": [6], "phase": "prefill"},
        {"req_id": "a", "token_pos": 0, "layer": 1, "experts": [7]},
        {"req_id": 9, "token_pos": 0, "layer": 1, "experts": [0], "phase": "prefill"},
        {"req_id": 9, "token_pos": 1, "layer": 1, "experts": [1], "phase": "decode"},
    ])
    trace = read_routing_trace(path)
    assert list(trace.steps()) == [
        (9, 0, "prefill", {1: [0], 3: [6]}),
        (9, 1, "decode", {1: [1], 3: [4]}),
        ("a", 0, "decode", {1: [7], 3: [5]}),  # a step's phase is its lowest layer's
    ]
    assert [r.layer for r in trace.records] == [3, 3, 3, 1, 1, 1]  # records stay in file order


def test_repeated_records_are_a_rerun_not_a_merge(tmp_path):
    # two prompts without sequence ids, both from position 0 (a seq-less dump of two runs), the
    # second one written layer-major: each repeat of (seq, pos, layer) belongs to the next run
    path = write_lines(tmp_path / "t.jsonl", [
        {"token_pos": 0, "layer": 0, "experts": [1]},
        {"token_pos": 0, "layer": 1, "experts": [2]},
        {"token_pos": 1, "layer": 0, "experts": [3]},
        {"token_pos": 1, "layer": 1, "experts": [4]},
        {"token_pos": 0, "layer": 0, "experts": [5]},
        {"token_pos": 1, "layer": 0, "experts": [6]},
        {"token_pos": 0, "layer": 1, "experts": [7]},
        {"token_pos": 1, "layer": 1, "experts": [0]},
    ])
    assert list(read_routing_trace(path).steps()) == [
        (None, 0, "decode", {0: [1], 1: [2]}),
        (None, 1, "decode", {0: [3], 1: [4]}),
        (None, 0, "decode", {0: [5], 1: [7]}),
        (None, 1, "decode", {0: [6], 1: [0]}),
    ]
