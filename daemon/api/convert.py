"""Wire <-> native translation: protobuf messages are parsed here and never travel inward."""

from __future__ import annotations

from moed.engine.request import TokenLogprob
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError, quoted
from moed.text.grammar import Grammar
from moed.v1 import control_pb2, inference_pb2

DEFAULT_MAX_TOKENS = 256


def sampling_from_proto(msg: inference_pb2.SamplingParams) -> SamplingParams:
    """Validated SamplingParams (InvalidRequestError names the bad field)."""
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        min_p=float(msg.min_p),
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_tokens=int(msg.max_tokens) or DEFAULT_MAX_TOKENS,
        stop=tuple(msg.stop),
        ignore_eos=bool(msg.ignore_eos),
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items())),
        grammar=Grammar(msg.grammar.kind, msg.grammar.text) if msg.HasField("grammar") else None,
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
    )


def logprobs_to_proto(logprobs: tuple[TokenLogprob, ...]) -> list[inference_pb2.TokenLogprob]:
    return [inference_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[i for i, _ in lp.top],
                                       top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


CHAT_ROLES = ("system", "user", "assistant", "tool")


def messages_from_proto(chat: inference_pb2.ChatMessages) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("chat has no messages; send at least one {role, content}")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"chat.messages[{i}].role {quoted(m.role)} is not one of {', '.join(CHAT_ROLES)}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def model_info(entry=None, *, path=None, disk_bytes: int = 0, found=None, pool=None) -> control_pb2.ModelInfo:
    """A loaded model (``entry``), or one on disk (``found``: its catalog entry, or a bare ``path``)."""
    if entry is None:
        if found is not None:
            return control_pb2.ModelInfo(name=found.name, path=str(found.path), loaded=False, format=found.format,
                                         disk_bytes=found.size or disk_bytes, source=found.source, state="on disk")
        fmt = "gguf" if path.is_file() else "ftw" if (path / "ftw.json").is_file() else "hf"
        name = path.name[:-5] if fmt == "gguf" and path.name.lower().endswith(".gguf") else path.name
        return control_pb2.ModelInfo(name=name, path=str(path), loaded=False, disk_bytes=disk_bytes, format=fmt,
                                     source="moed", state="on disk")
    stats = entry.stats
    info = control_pb2.ModelInfo(
        name=entry.name, path=str(entry.path), format=entry.runtime.loaded.format,
        family=entry.runtime.model.config.family, loaded=True, experts_dtype=entry.runtime.loaded.bank.dtype,
        disk_bytes=disk_bytes, host_bytes=entry.host_bytes(), vram_bytes=entry.vram_bytes(), device=stats.device,
        policy=stats.policy, context_length=entry.loop.context_length, active_requests=entry.loop.num_active,
        state="generating" if entry.loop.num_active else "idle", source=entry.source)
    expires = pool.expires_in(entry.name) if pool is not None else None
    if expires is not None:
        info.expires_in_seconds = expires
    return info


def engine_figures(stats, kv=None) -> control_pb2.EngineFigures:
    """From the executor's EngineStats, and the engine loop's KVFigures when given."""
    return control_pb2.EngineFigures(
        device=stats.device, policy=stats.policy, hits=stats.hits, misses=stats.misses, fills=stats.fills,
        cpu_experts=stats.cpu_experts, transient_fills=stats.transient_fills, last_q=stats.last_q, last_m=stats.last_m, b_p=stats.b_p, b_h=stats.b_h,
        cache_slots=stats.cache_slots, cache_bytes=stats.cache_bytes, pinned_bytes=stats.pinned_bytes,
        pageable_bytes=stats.pageable_bytes, pin_note=stats.pin_note,
        model_device_bytes=getattr(stats, "model_device_bytes", 0), model_note=getattr(stats, "model_note", ""),
        streamed_layers=getattr(stats, "streamed_layers", 0),
        **({} if kv is None else dict(
            kv_blocks=kv.num_blocks, kv_block_size=kv.block_size, kv_used_blocks=kv.used_blocks,
            kv_cached_blocks=kv.cached_blocks, kv_bytes=kv.pool_bytes, prompt_tokens=kv.prompt_tokens,
            cached_prompt_tokens=kv.cached_tokens, kv_evicted_blocks=kv.evicted_blocks, prefix_cache=kv.prefix_cache,
            kv_preempted=kv.preempted, state_checkpoints=kv.checkpoints,
            state_checkpoint_bytes=kv.checkpoint_bytes)))


def memory_figures(figures: dict) -> control_pb2.MemoryFigures:
    """From MemoryGovernor.figures() (+ host RAM); None (unlimited / no cap) becomes 0."""
    def num(key: str) -> int:
        value = figures.get(key)
        return int(value) if value is not None else 0

    return control_pb2.MemoryFigures(
        has_gpu=bool(figures.get("has_gpu")), vram_total=num("vram_total"), vram_free=num("vram_free"),
        vram_other_apps=num("vram_other_apps"), vram_ours=num("vram_ours"), budget_bytes=num("budget_bytes"),
        cap_bytes=num("cap_bytes"), host_total=num("host_total"), host_available=num("host_available"),
        source=str(figures.get("source", "none")))
