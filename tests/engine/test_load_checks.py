"""What a model load checks before it reads weights, and what a failed load leaves behind (issue #9)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from helpers.tiny_models import FAMILIES, build_tiny_model, build_tiny_model_dir
from moed.engine import model_manager as mm
from moed.engine.load_plan import plan_load
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.engine.runtime import open_runtime
from moed.errors import InsufficientMemoryError, InvalidRequestError, ModelExistsError, ModelFormatError
from moed.models.moe_transformer import kv_cache_bytes
from moed.weights.model_loader import read_model_config

GB = 10**9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if anything opens the weights (open_runtime is where reading starts)."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the weights were read although the load should have been refused before")

    monkeypatch.setattr(mm, "open_runtime", refuse)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_bytes_from_the_config_equal_what_the_model_allocates(family, tmp_path):
    build_tiny_model(family, tmp_path)
    runtime = open_runtime(tmp_path)
    try:
        for slots, length in ((1, 1), (3, 17), (8, 128)):
            cache = runtime.model.new_cache(slots, length)
            want = kv_cache_bytes(read_model_config(tmp_path), slots, length, runtime.model.kv_dtype)
            assert want == cache.nbytes() > 0
    finally:
        runtime.close()


def test_a_kv_pool_that_does_not_fit_is_refused_before_reading_and_says_what_would_fit(models, no_weight_reads):
    plan = plan_load(models / "tiny", LoadOptions(max_batch=8, context_length=256, kv_tokens=4096))
    assert plan.kv_tokens == 4096 and plan.kv_bytes == 4096 * plan.kv_bytes_per_token
    # room for the weights and a pool of 1000 tokens: a 992-token pool (whole blocks) would fit
    available = plan.weight_bytes + plan.workspace_bytes + 1000 * plan.kv_bytes_per_token
    manager = ModelManager([models], host_ram_available=lambda: available)
    with pytest.raises(InsufficientMemoryError) as info:
        manager.load("tiny", LoadOptions(device="cpu", max_batch=8, context_length=256, kv_tokens=4096))
    message = str(info.value)
    assert "KV pool for 4096 tokens, context 256" in message and "kv_tokens 992" in message, message
    # a pool smaller than one context: a shorter context is the way
    tiny_room = plan.weight_bytes + plan.workspace_bytes + 100 * plan.kv_bytes_per_token
    manager = ModelManager([models], host_ram_available=lambda: tiny_room)
    with pytest.raises(InsufficientMemoryError, match="context 96 with kv_tokens 96"):
        manager.load("tiny", LoadOptions(device="cpu", max_batch=8, context_length=256))
    assert no_weight_reads == [] and manager.loaded() == [] and not manager.is_loading


def test_the_pool_defaults_to_two_contexts_and_refuses_less_than_one(models):
    assert plan_load(models / "tiny", LoadOptions(max_batch=8, context_length=256)).kv_tokens == 512
    assert plan_load(models / "tiny", LoadOptions(max_batch=1, context_length=250)).kv_tokens == 256  # whole blocks
    with pytest.raises(InvalidRequestError, match="at least one whole context"):
        plan_load(models / "tiny", LoadOptions(context_length=256, kv_tokens=100))


def test_weights_too_big_in_every_dtype_say_what_the_smallest_needs(models, no_weight_reads):
    manager = ModelManager([models], host_ram_available=lambda: 1000)
    with pytest.raises(InsufficientMemoryError, match="even --experts-dtype mxfp4 needs .*more RAM"):
        manager.load("tiny", LoadOptions(device="cpu"))


def test_the_estimate_is_what_the_load_really_allocates(models):
    from moed.weights.model_loader import estimate_load

    for dtype in (None, "bf16", "int4", "q8", "mxfp4"):
        est = estimate_load(models / "tiny", dtype)
        runtime = open_runtime(models / "tiny", experts_dtype=dtype)
        try:
            assert est.bank_dtype == runtime.loaded.bank.dtype == (dtype or "fp32")  # fp32 source: fp32 bank
            assert est.bank_bytes == runtime.loaded.bank.nbytes() == est.bank_bytes_by_dtype[est.bank_dtype]
            assert est.weight_bytes == sum(t.numel() * t.element_size() for t in runtime.loaded.weights.values())
            assert est.working_bytes > 0
            assert est.kv_dtype == runtime.model.kv_dtype == torch.float32  # an fp32 checkpoint keeps fp32 K/V
        finally:
            runtime.close()


def test_a_model_that_fits_only_in_a_smaller_expert_dtype_is_told_which(models, no_weight_reads):
    plan = plan_load(models / "tiny", LoadOptions(max_batch=1, context_length=16))
    sizes = dict(plan.weight_bytes_by_dtype)
    assert plan.bank_dtype == "fp32" and sizes["bf16"] < plan.weight_bytes and sizes["int4"] < sizes["q8"] < sizes["bf16"]
    # room for q8 (and smaller) experts, not for bf16 ones: q8 is the best that fits
    available = (sizes["q8"] + sizes["bf16"]) // 2 + plan.kv_bytes
    manager = ModelManager([models], host_ram_available=lambda: available)
    with pytest.raises(InsufficientMemoryError, match=r"would fit: --experts-dtype q8 \(") as info:
        manager.load("tiny", LoadOptions(device="cpu", max_batch=1, context_length=16))
    assert "\n" not in str(info.value) and no_weight_reads == []


@pytest.mark.parametrize("options,words", [
    (dict(context_length=1), "at least 2"),
    (dict(context_length=10**6), "max_position_embeddings"),
    (dict(max_batch=0), "max_batch"),
    (dict(max_batch=5000), "max_step_tokens"),
    (dict(max_queue=-1), "max_queue"),
    (dict(experts_dtype="fp4"), "experts_dtype"),
    (dict(weights_dtype="fp16"), "weights_dtype"),
    (dict(device="tpu"), "unknown device"),
    (dict(device="emulated", emulated_b_p=float("inf")), "emulated_b_p"),
    (dict(device="emulated", emulated_b_p=5e-324), "emulated_b_p"),
    (dict(device="emulated", emulated_b_p=float("nan")), "emulated_b_p"),
])
def test_bad_options_are_refused_before_any_weight_is_read(models, no_weight_reads, options, words):
    manager = ModelManager([models])
    with pytest.raises(InvalidRequestError, match=words):
        manager.load("tiny", LoadOptions(**options))
    assert no_weight_reads == [] and manager.loaded() == [] and not manager.is_loading


def test_a_load_failing_after_the_read_closes_what_it_built(models, monkeypatch):
    closed = []
    real_open = mm.open_runtime

    def open_then_track(*args, **kwargs):
        runtime = real_open(*args, **kwargs)
        close = runtime.close
        runtime.close = lambda: (closed.append(True), close())
        return runtime

    def loop_fails(*args, **kwargs):
        raise RuntimeError("injected: the engine loop could not be built")

    monkeypatch.setattr(mm, "open_runtime", open_then_track)
    monkeypatch.setattr(mm, "EngineLoop", loop_fails)
    manager = ModelManager([models])
    with pytest.raises(RuntimeError, match="injected"):
        manager.load("tiny", LoadOptions(device="cpu"))
    assert closed == [True], "the runtime of a failed load was not closed"
    assert manager.loaded() == [] and not manager.is_loading
    monkeypatch.undo()
    entry = manager.load("tiny", LoadOptions(device="cpu"))  # the name is free again
    assert manager.unload(entry.name)


def test_two_concurrent_loads_of_one_name_load_it_once(models, monkeypatch):
    gate = threading.Barrier(2)
    release = threading.Event()
    real_open = mm.open_runtime

    def slow_open(*args, **kwargs):
        release.wait(10)  # the first load holds here until the second has been refused
        return real_open(*args, **kwargs)

    monkeypatch.setattr(mm, "open_runtime", slow_open)
    manager = ModelManager([models])
    outcomes: list = [None, None]

    def load(i: int) -> None:
        gate.wait(10)
        try:
            outcomes[i] = manager.load("tiny", LoadOptions(device="cpu"))
        except ModelExistsError as exc:
            outcomes[i] = exc
            release.set()

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    release.set()
    errors = [o for o in outcomes if isinstance(o, ModelExistsError)]
    entries = [o for o in outcomes if o is not None and not isinstance(o, Exception)]
    assert len(errors) == 1 and len(entries) == 1, outcomes
    assert "is being loaded" in str(errors[0])
    assert [e.name for e in manager.loaded()] == ["tiny"]
    assert manager.unload("tiny") and manager.loaded() == []


def test_a_fifo_among_the_weights_is_refused_without_blocking(models, tmp_path):
    d = tmp_path / "fifo-model"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / "tiny" / name, d / name)
    os.mkfifo(d / "model.safetensors")
    manager = ModelManager([tmp_path])
    result: dict = {}

    def load() -> None:
        try:
            manager.load(str(d), LoadOptions(device="cpu"))
        except ModelFormatError as exc:
            result["error"] = str(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(20)
    assert not loader.is_alive(), "the load blocked on the FIFO"
    assert "named pipe" in result.get("error", "") and "model.safetensors" in result["error"]
    assert not manager.is_loading


def test_error_messages_quote_at_most_a_bounded_part_of_the_input(models):
    manager = ModelManager([models])
    huge = "m" * 100_000
    with pytest.raises(InvalidRequestError) as info:
        manager.load(huge, LoadOptions(device="cpu"))
    assert len(str(info.value)) < 1000 and "100002 characters" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        manager.get(huge)
    assert len(str(info.value)) < 1000


def test_tiny_temperatures_and_extreme_penalties_still_sample():
    from moed.engine.sampling import Sampler, SamplingParams

    logits = torch.tensor([0.5, 3.0, -2.0, 2.9, 1.0])
    for t in (1e-40, 5e-324, 1e-6, 1e-5, 1e-3):
        token = Sampler(SamplingParams(temperature=t, seed=1)).sample(logits, [])
        assert token == 1, f"temperature {t}: the top logit's token, got {token}"
    for penalty in (1e-45, 5e-324, 1e300):
        s = Sampler(SamplingParams(temperature=0.7, repetition_penalty=penalty, seed=2))
        token = s.sample(logits, [1, 3])
        assert 0 <= token < 5
    # a tiny penalty makes the seen positive logits huge: they win
    assert Sampler(SamplingParams(temperature=0.5, repetition_penalty=1e-45, seed=3)).sample(logits, [4]) == 4


def test_the_automatic_context_is_the_longest_the_model_supports_that_half_the_free_ram_holds():
    from moed.engine.load_plan import auto_context

    # a Qwen3-30B-A3B-shaped model: 48 layers x 4 KV heads x 128 x (K, V) x bf16 = 96 KiB per token, 17 GB of weights
    per_token = 48 * 4 * 128 * 2 * 2
    on_64 = auto_context(262144, per_token, 17 * GB, 64 * GB, max_batch=8)
    assert on_64 == (47 * GB // 2) // per_token // 2 // 16 * 16  # two whole contexts in half the free RAM
    assert 100_000 < on_64 < 131072
    assert auto_context(40960, per_token, 17 * GB, 64 * GB, max_batch=8) == 40960  # the model's own limit
    assert auto_context(262144, per_token, 17 * GB, 64 * GB, max_batch=1) == 2 * on_64  # one sequence: one context
    assert auto_context(262144, per_token, 17 * GB, 18 * GB, max_batch=8) == 4096  # tight: the floor (the fit check decides)
    assert auto_context(2048, per_token, 17 * GB, 18 * GB, max_batch=8) == 2048
    assert auto_context(262144, per_token, 17 * GB, 64 * GB, max_batch=8, kv_tokens=50_000) == 50_000  # the pool's length


def test_a_load_without_a_context_gets_the_automatic_one(models, no_weight_reads):
    config = read_model_config(models / "tiny")
    roomy = plan_load(models / "tiny", LoadOptions(max_batch=4), available_bytes=1 << 40)
    assert roomy.context_length == config.max_position_embeddings
    assert roomy.kv_tokens == 2 * roomy.context_length
    tight = plan_load(models / "tiny", LoadOptions(max_batch=4), available_bytes=roomy.weight_bytes)
    assert tight.context_length == config.max_position_embeddings  # the floor: min(4096, the model's limit)
    assert plan_load(models / "tiny", LoadOptions(max_batch=4, context_length=100),
                     available_bytes=1 << 40).context_length == 100  # asked for: kept


def test_a_hybrid_models_states_and_checkpoints_are_in_the_load_plan(tmp_path):
    """A gated-DeltaNet model keeps a recurrent state per batch row and up to checkpoint_bytes of state
    checkpoints: both are planned (and checked against free RAM) with the weights and the KV pool."""
    root = build_tiny_model_dir(tmp_path / "models", "qwen3_next", "hybrid")
    plan = plan_load(root / "hybrid", LoadOptions(max_batch=3, context_length=64))
    assert plan.checkpoint_bytes == 1 << 30 and plan.state_bytes > 0
    assert plan.workspace_bytes > 0
    assert plan.total_bytes == (plan.weight_bytes + plan.kv_bytes + plan.state_bytes + plan.checkpoint_bytes
                                + plan.workspace_bytes)
    manager = ModelManager([root])
    entry = manager.load("hybrid", LoadOptions(device="cpu", max_batch=3, context_length=64, checkpoint_bytes=12345))
    try:
        assert entry.loop._cache.state_nbytes() == plan.state_bytes  # noqa: SLF001 - what the loop allocated
        assert entry.loop._kv.checkpoint_budget == 12345  # noqa: SLF001
        assert entry.loop.state_bytes() == plan.state_bytes + 12345
    finally:
        manager.close()
    no_cache = plan_load(root / "hybrid", LoadOptions(max_batch=3, context_length=64, prefix_cache=False))
    assert no_cache.checkpoint_bytes == 0 and no_cache.state_bytes == plan.state_bytes
    short = ModelManager([root], host_ram_available=lambda: plan.weight_bytes + plan.kv_bytes + plan.state_bytes
                         + plan.workspace_bytes)
    with pytest.raises(InsufficientMemoryError, match="recurrent states and state checkpoints"):
        short.load("hybrid", LoadOptions(device="cpu", max_batch=3, context_length=64))
    with pytest.raises(InvalidRequestError, match="checkpoint_bytes"):
        plan_load(root / "hybrid", LoadOptions(context_length=64, checkpoint_bytes=-1))
    build_tiny_model("qwen3_moe", root / "plain")
    plain = plan_load(root / "plain", LoadOptions(context_length=64))
    assert plain.state_bytes == plain.checkpoint_bytes == 0


def test_the_device_split_leaves_room_for_a_hybrid_models_states_and_checkpoints():
    """With the model on a device its states and checkpoints sit next to the KV pool, and a step's activations
    need room beside them: the KV blocks and the expert cache share what is left of the model's VRAM share
    after the weights, the states and the step workspace."""
    from types import SimpleNamespace

    resized = []
    loop = SimpleNamespace(kv_block_bytes=lambda: 1000, kv_full_blocks=100, kv_floor_blocks=lambda: 10,
                           kv_num_blocks=100, resize_kv=resized.append, state_bytes=lambda: 30_000,
                           workspace_bytes=lambda: 0)
    entry = SimpleNamespace(loop=loop, runtime=SimpleNamespace(model=SimpleNamespace(weight_device_bytes=50_000)))
    experts = ModelManager._split_device_share(entry, 200_000, 40_000)  # noqa: SLF001
    assert resized == [80]  # 200k - 50k weights - 30k states - 40k experts = 80 blocks of 1000
    assert experts == 40_000
    loop.state_bytes, loop.kv_num_blocks = (lambda: 0), 80
    resized.clear()
    ModelManager._split_device_share(entry, 200_000, 40_000)  # noqa: SLF001
    assert resized == [100]  # without states the whole pool (100 blocks) fits
    loop.workspace_bytes, loop.kv_num_blocks = (lambda: 45_000), 100
    resized.clear()
    experts = ModelManager._split_device_share(entry, 200_000, 40_000)  # noqa: SLF001
    assert resized == [65] and experts == 40_000  # 200k - 50k - 45k step activations - 40k = 65 blocks
    experts = ModelManager._split_device_share(entry, 120_000, 40_000)  # noqa: SLF001
    assert resized[-1] == 10 and experts == 15_000  # 120k - 50k - 45k: the KV in use (10 blocks), then experts


def test_the_absorbed_mla_copy_of_kv_b_is_planned_for_half_precision_weights(tmp_path):
    from moed.engine.load_plan import absorbed_mla_bytes

    build_tiny_model("deepseek_v3", tmp_path / "mla")
    config = read_model_config(tmp_path / "mla")
    a = config.attention
    per_layer = 4 * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
    assert absorbed_mla_bytes(config, torch.bfloat16) == per_layer * config.num_layers > 0
    assert absorbed_mla_bytes(config, torch.float32) == 0  # a float32 kv_b is used as it is
    plan = plan_load(tmp_path / "mla", LoadOptions(context_length=64))  # the tiny model is float32
    assert plan.absorbed_bytes == 0
    build_tiny_model("qwen3_moe", tmp_path / "mha")
    assert absorbed_mla_bytes(read_model_config(tmp_path / "mha"), torch.bfloat16) == 0
