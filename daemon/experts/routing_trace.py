"""Routing traces: which experts each token chose in each MoE layer, as JSON lines.

One line per (sequence, token position, layer):
``{"type": "route", "req_id": ..., "token_pos": 7, "layer": 3, "experts": [5, 12], "phase": "decode"}``.
The reader also takes the field names of other tools' dumps (``topk_ids``, ``token_idx``,
``problem_id``, ``seq``) and parses everything into plain ints at the edge. Lines may come in
any order: token-major (ours: one token's layers, then the next token) or layer-major (many public
dumps: every token of layer 0, then layer 1, ...); ``RoutingTrace.steps`` puts them back in the
order a decoder executes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Mapping, Sequence, Union

from moed.errors import InvalidRequestError

TRACE_PHASES = ("prefill", "decode")
SeqId = Union[str, int, None]
Step = tuple[SeqId, int, str, dict[int, list[int]]]


@dataclass(frozen=True)
class RouteRecord:
    seq: SeqId
    token_pos: int
    phase: str
    layer: int
    experts: tuple[int, ...]


@dataclass
class RoutingTrace:
    """Records in file order, plus the id space they live in; ``steps`` replays them in
    execution order."""

    records: list[RouteRecord] = field(default_factory=list)
    num_experts: int = 0

    def __len__(self) -> int:
        return len(self.records)

    @property
    def layers(self) -> list[int]:
        """The distinct layer numbers, ascending (a model's MoE layers, maybe not 0..L-1)."""
        return sorted({r.layer for r in self.records})

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def steps(self) -> Iterator[Step]:
        """(seq, token_pos, phase, {layer: experts}) per token position, in execution order:
        sequences in the order the file first mentions them, each one's positions ascending,
        layers ascending within a position; whatever order the records came in.

        Several records for the same (seq, token_pos, layer) mean the sequence was computed
        again (a re-run, or a trace of several prompts without sequence ids): the k-th record of
        a key belongs to the k-th run of that sequence, and each run replays as a sequence of
        its own, placed where the file first mentions it. Nothing is merged or dropped, so a
        re-run costs its cache traffic again. ``phase`` is the phase of the step's lowest layer.
        """
        runs: dict[tuple[SeqId, int, int], int] = {}  # (seq, pos, layer) -> records seen so far
        order: dict[tuple[SeqId, int], int] = {}  # (seq, run) -> rank of first mention
        keyed = []
        for r in self.records:
            run = runs.get((r.seq, r.token_pos, r.layer), 0)
            runs[r.seq, r.token_pos, r.layer] = run + 1
            rank = order.setdefault((r.seq, run), len(order))
            keyed.append((rank, r.token_pos, r.layer, r))
        keyed.sort(key=lambda k: k[:3])  # ranks, not ids: ids may mix str, int and None
        current: Step | None = None
        current_key: tuple[int, int] | None = None
        for rank, pos, layer, r in keyed:
            if current is None or current_key != (rank, pos):
                if current is not None:
                    yield current
                current, current_key = (r.seq, pos, r.phase, {}), (rank, pos)
            current[3][layer] = list(r.experts)
        if current is not None:
            yield current

    @classmethod
    def from_steps(cls, steps: Sequence[Step] | Iterator[Step], num_experts: int) -> "RoutingTrace":
        records = [RouteRecord(seq, int(pos), phase, int(layer), tuple(int(e) for e in experts))
                   for seq, pos, phase, by_layer in steps for layer, experts in sorted(by_layer.items())]
        return cls(records, int(num_experts))


class RoutingTraceWriter:
    """Appends route records as JSON lines; ``write_step`` flushes, so a crash loses at most a step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")

    def write(self, req_id: str | int, token_pos: int, layer: int, experts: Sequence[int],
              phase: str = "decode") -> None:
        if self._file is None:
            raise ValueError(f"routing trace {self.path} is closed")
        if phase not in TRACE_PHASES:
            raise ValueError(f"routing trace phase must be one of {TRACE_PHASES}, got {phase!r}")
        line = {"type": "route", "req_id": req_id, "token_pos": int(token_pos), "layer": int(layer),
                "experts": [int(e) for e in experts], "phase": phase}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def write_step(self, req_id: str | int, token_pos: int, phase: str,
                   experts_by_layer: Mapping[int, Sequence[int]]) -> None:
        """All layers of one token position, then a flush."""
        for layer, experts in experts_by_layer.items():
            self.write(req_id, token_pos, layer, experts, phase)
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "RoutingTraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _int_field(obj: dict, names: Sequence[str], where: str, required: bool) -> int | None:
    for name in names:
        if name in obj:
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(f"{where}: field {name!r} must be an integer, got {value!r}")
            return value
    if required:
        raise InvalidRequestError(f"{where}: missing field {' or '.join(map(repr, names))}")
    return None


def _parse_line(obj: object, where: str, num_experts: int | None) -> RouteRecord | None:
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "type" in obj and obj["type"] != "route":
        return None
    layer = _int_field(obj, ("layer",), where, required=True)
    if layer < 0:
        raise InvalidRequestError(f"{where}: layer must be >= 0, got {layer}")
    key = next((k for k in ("experts", "topk_ids") if k in obj), None)
    if key is None:
        raise InvalidRequestError(f"{where}: missing field 'experts' or 'topk_ids'")
    experts = obj[key]
    if not isinstance(experts, list) or any(isinstance(e, bool) or not isinstance(e, int) for e in experts):
        raise InvalidRequestError(f"{where}: field {key!r} must be a list of integers, got {experts!r}")
    bad = [e for e in experts if e < 0 or (num_experts is not None and e >= num_experts)]
    if bad:
        limit = f"0..{num_experts - 1}" if num_experts is not None else ">= 0"
        raise InvalidRequestError(f"{where}: expert ids {bad} are out of range ({limit}); "
                                  "check --num-experts against the model that produced the trace")
    pos = _int_field(obj, ("token_pos", "token_idx"), where, required=True)
    seq = next((obj[k] for k in ("req_id", "problem_id", "seq") if k in obj), None)
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, (str, int))):
        raise InvalidRequestError(f"{where}: sequence id must be a string or integer, got {seq!r}")
    phase = obj.get("phase", "decode")
    if phase not in TRACE_PHASES:
        raise InvalidRequestError(f"{where}: phase must be one of {TRACE_PHASES}, got {phase!r}")
    return RouteRecord(seq, pos, phase, layer, tuple(experts))


def read_routing_trace(path: str | Path, num_experts: int | None = None) -> RoutingTrace:
    """Parse a JSON-lines routing trace; ``num_experts`` defaults to the largest id + 1."""
    path = Path(path)
    if num_experts is not None and num_experts < 1:
        raise InvalidRequestError(f"num_experts must be >= 1, got {num_experts}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidRequestError(f"routing trace {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read routing trace {path}: {exc}") from None
    records: list[RouteRecord] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"routing trace {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: not valid JSON ({exc.msg}); "
                                      "expected one JSON object per line") from None
        record = _parse_line(obj, where, num_experts)
        if record is not None:
            records.append(record)
    if num_experts is None:
        num_experts = 1 + max((max(r.experts) for r in records if r.experts), default=-1)
        num_experts = max(num_experts, 1)
    return RoutingTrace(records, num_experts)
