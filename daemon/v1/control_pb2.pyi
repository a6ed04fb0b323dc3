from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "name", "device", "policy", "cache_fraction", "context_length", "experts_dtype", "verify", "max_batch", "max_queue", "emulated_b_p", "weights_dtype", "no_prefix_cache", "kv_tokens", "kv_type")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    EMULATED_B_P_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    device: str
    policy: str
    cache_fraction: float
    context_length: int
    experts_dtype: str
    verify: bool
    max_batch: int
    max_queue: int
    emulated_b_p: float
    weights_dtype: str
    no_prefix_cache: bool
    kv_tokens: int
    kv_type: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., policy: _Optional[str] = ..., cache_fraction: _Optional[float] = ..., context_length: _Optional[int] = ..., experts_dtype: _Optional[str] = ..., verify: _Optional[bool] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ..., emulated_b_p: _Optional[float] = ..., weights_dtype: _Optional[str] = ..., no_prefix_cache: _Optional[bool] = ..., kv_tokens: _Optional[int] = ..., kv_type: _Optional[str] = ...) -> None: ...

class LoadModelProgress(_message.Message):
    __slots__ = ("stage", "done_bytes", "total_bytes", "model")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done_bytes: int
    total_bytes: int
    model: ModelInfo
    def __init__(self, stage: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "path", "format", "family", "loaded", "experts_dtype", "disk_bytes", "host_bytes", "vram_bytes", "device", "policy", "context_length", "active_requests", "source", "state", "expires_in_seconds", "load_seconds", "load_fraction")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    VRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FRACTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    format: str
    family: str
    loaded: bool
    experts_dtype: str
    disk_bytes: int
    host_bytes: int
    vram_bytes: int
    device: str
    policy: str
    context_length: int
    active_requests: int
    source: str
    state: str
    expires_in_seconds: float
    load_seconds: float
    load_fraction: float
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., format: _Optional[str] = ..., family: _Optional[str] = ..., loaded: _Optional[bool] = ..., experts_dtype: _Optional[str] = ..., disk_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., vram_bytes: _Optional[int] = ..., device: _Optional[str] = ..., policy: _Optional[str] = ..., context_length: _Optional[int] = ..., active_requests: _Optional[int] = ..., source: _Optional[str] = ..., state: _Optional[str] = ..., expires_in_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., load_fraction: _Optional[float] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class SetVramCapRequest(_message.Message):
    __slots__ = ("cap_bytes", "cap_fraction")
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    cap_bytes: int
    cap_fraction: float
    def __init__(self, cap_bytes: _Optional[int] = ..., cap_fraction: _Optional[float] = ...) -> None: ...

class SetServingRequest(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class EngineFigures(_message.Message):
    __slots__ = ("device", "policy", "hits", "misses", "fills", "cpu_experts", "last_q", "last_m", "b_p", "b_h", "cache_slots", "cache_bytes", "pinned_bytes", "pageable_bytes", "pin_note", "transient_fills", "model_device_bytes", "model_note", "streamed_layers", "kv_blocks", "kv_block_size", "kv_used_blocks", "kv_cached_blocks", "kv_bytes", "prompt_tokens", "cached_prompt_tokens", "kv_evicted_blocks", "prefix_cache", "kv_preempted", "state_checkpoints", "state_checkpoint_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    FILLS_FIELD_NUMBER: _ClassVar[int]
    CPU_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAST_Q_FIELD_NUMBER: _ClassVar[int]
    LAST_M_FIELD_NUMBER: _ClassVar[int]
    B_P_FIELD_NUMBER: _ClassVar[int]
    B_H_FIELD_NUMBER: _ClassVar[int]
    CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGEABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_NOTE_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FILLS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_NOTE_FIELD_NUMBER: _ClassVar[int]
    STREAMED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    policy: str
    hits: int
    misses: int
    fills: int
    cpu_experts: int
    last_q: int
    last_m: int
    b_p: float
    b_h: float
    cache_slots: int
    cache_bytes: int
    pinned_bytes: int
    pageable_bytes: int
    pin_note: str
    transient_fills: int
    model_device_bytes: int
    model_note: str
    streamed_layers: int
    kv_blocks: int
    kv_block_size: int
    kv_used_blocks: int
    kv_cached_blocks: int
    kv_bytes: int
    prompt_tokens: int
    cached_prompt_tokens: int
    kv_evicted_blocks: int
    prefix_cache: bool
    kv_preempted: int
    state_checkpoints: int
    state_checkpoint_bytes: int
    def __init__(self, device: _Optional[str] = ..., policy: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., fills: _Optional[int] = ..., cpu_experts: _Optional[int] = ..., last_q: _Optional[int] = ..., last_m: _Optional[int] = ..., b_p: _Optional[float] = ..., b_h: _Optional[float] = ..., cache_slots: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., pageable_bytes: _Optional[int] = ..., pin_note: _Optional[str] = ..., transient_fills: _Optional[int] = ..., model_device_bytes: _Optional[int] = ..., model_note: _Optional[str] = ..., streamed_layers: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_cached_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_evicted_blocks: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., kv_preempted: _Optional[int] = ..., state_checkpoints: _Optional[int] = ..., state_checkpoint_bytes: _Optional[int] = ...) -> None: ...

class MemoryFigures(_message.Message):
    __slots__ = ("has_gpu", "vram_total", "vram_free", "vram_other_apps", "vram_ours", "budget_bytes", "cap_bytes", "host_total", "host_available", "source")
    HAS_GPU_FIELD_NUMBER: _ClassVar[int]
    VRAM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VRAM_FREE_FIELD_NUMBER: _ClassVar[int]
    VRAM_OTHER_APPS_FIELD_NUMBER: _ClassVar[int]
    VRAM_OURS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    has_gpu: bool
    vram_total: int
    vram_free: int
    vram_other_apps: int
    vram_ours: int
    budget_bytes: int
    cap_bytes: int
    host_total: int
    host_available: int
    source: str
    def __init__(self, has_gpu: _Optional[bool] = ..., vram_total: _Optional[int] = ..., vram_free: _Optional[int] = ..., vram_other_apps: _Optional[int] = ..., vram_ours: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., cap_bytes: _Optional[int] = ..., host_total: _Optional[int] = ..., host_available: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("state", "version", "models", "engine", "memory", "active_requests", "queued_requests", "tokens_per_second", "requests_served", "last_error", "cache_resizes", "http_url")
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHE_RESIZES_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    state: str
    version: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    engine: EngineFigures
    memory: MemoryFigures
    active_requests: int
    queued_requests: int
    tokens_per_second: float
    requests_served: int
    last_error: str
    cache_resizes: int
    http_url: str
    def __init__(self, state: _Optional[str] = ..., version: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., engine: _Optional[_Union[EngineFigures, _Mapping]] = ..., memory: _Optional[_Union[MemoryFigures, _Mapping]] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., requests_served: _Optional[int] = ..., last_error: _Optional[str] = ..., cache_resizes: _Optional[int] = ..., http_url: _Optional[str] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("model", "seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    seconds: float
    def __init__(self, model: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class CalibrateResponse(_message.Message):
    __slots__ = ("b_p", "b_h", "b_p_concurrent", "b_h_concurrent", "q_ratio", "device")
    B_P_FIELD_NUMBER: _ClassVar[int]
    B_H_FIELD_NUMBER: _ClassVar[int]
    B_P_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    B_H_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    Q_RATIO_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    b_p: float
    b_h: float
    b_p_concurrent: float
    b_h_concurrent: float
    q_ratio: float
    device: str
    def __init__(self, b_p: _Optional[float] = ..., b_h: _Optional[float] = ..., b_p_concurrent: _Optional[float] = ..., b_h_concurrent: _Optional[float] = ..., q_ratio: _Optional[float] = ..., device: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("cancel_inflight",)
    CANCEL_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    cancel_inflight: bool
    def __init__(self, cancel_inflight: _Optional[bool] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
