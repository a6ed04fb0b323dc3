"""`moed convert` streams: its peak RSS does not grow with the number of layers.

Two synthetic Qwen3-MoE checkpoints that differ only in depth (2 and 10 layers) are converted to
int4 FTW, each in a fresh subprocess that reports its peak RSS (VmHWM / ru_maxrss). A converter
that reads, converts and writes a layer (or a few experts) at a time peaks at about the same RSS
for both; one that gathers every expert as float32 stacks before building the bank (moed up to
and including commit dfc8a00) grows by ~6x the extra source bytes. The limit sits in between:
the 10-layer peak may exceed the 2-layer one by at most ``GROWTH_LIMIT`` x the extra source bytes.

What counts: VmHWM is anonymous memory *plus* file pages mapped into the process, so a converter
that keeps the source files mmapped (safetensors' ``safe_open``) shows every touched page of the
source in its RSS and fails here too (~1.07x). The failure message gives the anonymous / file
split (sampled) to tell the two apart.

Noise: the subprocesses run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc's default value, but
fixed: it turns off the dynamic threshold). At real sizes every expert tensor is far above glibc's
32 MiB dynamic-threshold cap, so big buffers are always mmapped and given back on free; at these
test sizes many are not, and heap fragmentation then moves the peak by 20-40 MB from run to run.
With the threshold fixed, a reference streaming loop peaks within 1 MB for 2 and 10 layers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.synthetic_checkpoint import checkpoint_nbytes, expected_tensor_shapes, write_qwen3_moe_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")

# Small but not tiny: per layer the experts are 64 x 3 x 256 x 256 bf16 = 25.2 MB of source, so
# the 8 extra layers add 204 MB (float32 stacks of them: 408 MB), far above RSS noise.
SIZES = dict(hidden=256, num_experts=64, moe_intermediate=256, top_k=4, num_heads=8, num_kv_heads=2,
             head_dim=32, vocab=2048)
SHALLOW, DEEP = 2, 10
GROWTH_LIMIT = 0.25  # peak(DEEP) - peak(SHALLOW) < GROWTH_LIMIT * (source(DEEP) - source(SHALLOW))
EXPERTS_DTYPE = "int4"

# Runs in a fresh interpreter: argv = src dst experts_dtype; prints one JSON line.
_CONVERT_SCRIPT = r"""
import json, resource, sys, threading, time

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

peaks = {"RssAnon": 0, "RssFile": 0}
stop = threading.Event()

def sample():  # diagnostics only: a sampled peak can miss a short spike; VmHWM cannot
    while not stop.is_set():
        s = status()
        for key in peaks:
            peaks[key] = max(peaks[key], s[key])
        time.sleep(0.002)

from moed.weights.converter import convert_model

src, dst, dtype = sys.argv[1:4]
before = status()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
started = time.perf_counter()
convert_model(src, dst, experts_dtype=dtype)
wall = time.perf_counter() - started
stop.set()
sampler.join()
after = status()
print(json.dumps({
    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    "vm_hwm": after["VmHWM"], "rss_before": before["VmRSS"], "hwm_before": before["VmHWM"],
    "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"], "wall_s": wall,
}))
"""


def _convert_in_subprocess(src: Path, dst: Path) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", _CONVERT_SCRIPT, str(src), str(dst), EXPERTS_DTYPE],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"convert of {src} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["peak"] = max(result["vm_hwm"], result["ru_maxrss"])
    return result


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[int, dict]:
    """{layers: {"src", "dst", "src_bytes", measurements...}}, converted one after the other."""
    root = tmp_path_factory.mktemp("streaming")
    runs = {}
    for layers in (SHALLOW, DEEP):
        src = write_qwen3_moe_checkpoint(root / f"hf-{layers}", num_layers=layers, **SIZES)
        dst = root / f"ftw-{layers}"
        runs[layers] = dict(_convert_in_subprocess(src, dst), src=src, dst=dst,
                            src_bytes=checkpoint_nbytes(num_layers=layers, **SIZES))
    return runs


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def test_convert_peak_rss_does_not_grow_with_layers(converted) -> None:
    shallow, deep = converted[SHALLOW], converted[DEEP]
    extra_src = deep["src_bytes"] - shallow["src_bytes"]
    growth = deep["peak"] - shallow["peak"]
    limit = GROWTH_LIMIT * extra_src
    report = (
        f"peak RSS {SHALLOW} layers {_mb(shallow['peak'])}, {DEEP} layers {_mb(deep['peak'])}: "
        f"{growth / 1e6:+.1f} MB = {growth / extra_src:.2f}x the {_mb(extra_src)} of extra source "
        f"(limit {GROWTH_LIMIT}x = {_mb(limit)}); sampled peaks anon {_mb(shallow['peak_anon'])} -> "
        f"{_mb(deep['peak_anon'])}, file-backed {_mb(shallow['peak_file'])} -> {_mb(deep['peak_file'])}; "
        f"RSS before convert {_mb(shallow['rss_before'])} / {_mb(deep['rss_before'])}; "
        f"wall {shallow['wall_s']:.1f} s / {deep['wall_s']:.1f} s"
    )
    print(report)
    assert growth < limit, "convert does not stream: " + report


def test_converted_ftw_has_expected_tensors(converted) -> None:
    from moed.weights.ftw_reader import read_ftw_index

    layers, d, i, e = DEEP, SIZES["hidden"], SIZES["moe_intermediate"], SIZES["num_experts"]
    index = read_ftw_index(converted[layers]["dst"])
    names = set(index.tensors)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 *(f"model.layers.{k}.{part}.weight" for k in (0, layers - 1)
                   for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "self_attn.q_norm", "self_attn.k_norm", "input_layernorm",
                                "post_attention_layernorm", "mlp.router"))):
        assert name in names, f"{name} missing from the FTW index"
        assert index.tensors[name].kind == "weight"
    source = expected_tensor_shapes(num_layers=layers, **SIZES)
    assert tuple(index.tensors["model.layers.3.self_attn.q_proj.weight"].shape) == \
        source["model.layers.3.self_attn.q_proj.weight"]
    assert tuple(index.tensors["model.layers.3.mlp.router.weight"].shape) == (e, d)
    # the routed experts live only in the bank, never as per-expert weights
    assert not [n for n in names if ".mlp.experts." in n or ".mlp.gate." in n]
    n = layers * e
    bank = {"experts.gate_up.q": ("uint8", (n, d, i)), "experts.down.q": ("uint8", (n, i, d // 2)),
            "experts.gate_up.scale": ("bfloat16", (n, d // 32, 2 * i)), "experts.gate_up.min": ("bfloat16", (n, d // 32, 2 * i)),
            "experts.down.scale": ("bfloat16", (n, i // 32, d)), "experts.down.min": ("bfloat16", (n, i // 32, d))}
    for name, (dtype, shape) in bank.items():
        t = index.tensors.get(name)
        assert t is not None, f"{name} missing from the FTW index"
        assert (t.kind, t.dtype, tuple(t.shape)) == ("expert_bank", dtype, shape), name
    bank_meta = index.metadata["bank"]
    assert (bank_meta["dtype"], bank_meta["num_moe_layers"], bank_meta["num_experts"]) == (EXPERTS_DTYPE, layers, e)
    assert "tokenizer.json" in index.extra_files and "config.json" in index.extra_files


def test_converted_model_loads_and_generates(converted) -> None:
    from moed.engine.offline_run import run_offline
    from moed.engine.runtime import open_runtime
    from moed.engine.sampling import SamplingParams

    runtime = open_runtime(converted[DEEP]["dst"])
    try:
        assert runtime.loaded.format == "ftw"
        assert runtime.loaded.config.num_layers == DEEP
        assert runtime.loaded.bank.dtype == EXPERTS_DTYPE
        prompt = runtime.encode_prompt("hello there", chat=False)
        (result,) = run_offline(runtime, [prompt], [SamplingParams(max_tokens=3, ignore_eos=True)],
                                context_length=64)
        assert not result.error and len(result.token_ids) == 3
        assert all(0 <= t < SIZES["vocab"] for t in result.token_ids)
    finally:
        runtime.close()


def test_converted_model_equals_loading_the_checkpoint_directly(converted) -> None:
    """The FTW written piecewise holds what loading the HF directory in one go gives."""
    from moed.weights.model_loader import load_model

    run = converted[SHALLOW]
    direct = load_model(run["src"], experts_dtype=EXPERTS_DTYPE)
    ftw = load_model(run["dst"])
    assert set(ftw.weights) == set(direct.weights)
    for name, t in direct.weights.items():
        assert torch.equal(ftw.weights[name].float(), t.float()), name
    assert set(ftw.bank.tensors) == set(direct.bank.tensors)
    for name, t in direct.bank.tensors.items():
        got = ftw.bank.tensors[name]
        assert got.dtype == t.dtype and torch.equal(got, t), f"bank tensor {name} differs"


def test_synthetic_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """Names, shapes and config.json are what transformers writes and reads for Qwen3MoeForCausalLM."""
    tf = pytest.importorskip("transformers")
    from safetensors import safe_open

    sizes = dict(num_layers=2, hidden=64, num_experts=4, moe_intermediate=32, top_k=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, vocab=512)
    ours = write_qwen3_moe_checkpoint(tmp_path / "ours", **sizes)

    def on_disk(path: Path) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return shapes

    config = tf.AutoConfig.from_pretrained(ours)
    assert type(config).__name__ == "Qwen3MoeConfig"
    torch.manual_seed(0)
    reference = tf.Qwen3MoeForCausalLM(config)
    reference.save_pretrained(tmp_path / "ref")
    want = on_disk(tmp_path / "ref")
    got = on_disk(ours)
    assert got == want
    assert got == expected_tensor_shapes(**sizes)
    ours_cfg = json.loads((ours / "config.json").read_text())
    ref_cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert ours_cfg.pop("dtype") == "bfloat16" and ref_cfg.pop("dtype") == "float32"  # the reference is float32
    assert ours_cfg == ref_cfg

    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert len(set(index["weight_map"].values())) == sizes["num_layers"] + 1  # one shard per layer + outer

    loaded, info = tf.Qwen3MoeForCausalLM.from_pretrained(ours, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
    assert {k: tuple(v.shape) for k, v in loaded.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert loaded.dtype == torch.bfloat16
    norm = loaded.model.layers[1].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    q = loaded.model.layers[1].self_attn.q_proj.weight.float()
    assert 0.015 < q.std().item() < 0.025
