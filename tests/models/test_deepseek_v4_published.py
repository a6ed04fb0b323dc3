"""DeepSeek-V4 as deepseek-ai publishes it (issue #33): tensors named without transformers' ``model.`` prefix
(``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``hc_head_fn``, ``head.weight``), attention and dense linears
in FP8 E4M3 with one E8M0 scale per 128x128 block (``X.scale``), routed experts in FP4 (``expert_dtype: "fp4"``:
int8 ``[rows, K/2]``, two E2M1 codes a byte, and an E8M0 scale per 32), and a multi-token-prediction layer
(``mtp.0.*``) that generation does not use.

A tiny checkpoint is written in that layout; the reference is transformers on the same weights decoded by
transformers' own FP8/FP4 dequantiser (``Fp8Dequantize``, what it applies when it loads this layout with
``dequantize=True``). moed keeps the FP8 linears FP8 (``PackedLinear("fp8")``) and the experts FP4 (mxfp4 bank)
on the CPU, both holding the checkpoint's values exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.native_switch import without_native_kernels
from helpers.reference_parity import assert_matches_reference
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError
from moed.layers.packed_linear import PackedLinear
from moed.weights.hf_checkpoint import HfCheckpoint
from moed.weights.model_loader import estimate_load, load_model

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.compressor.wkv",
               "attn.compressor.wgate", "attn.indexer.wq_b", "attn.indexer.compressor.wkv",
               "attn.indexer.compressor.wgate", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
               "ffn.shared_experts.w3")
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
         "activation_scheme": "dynamic"}


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power-of-two scale that brings ``amax`` within ``top`` (as DeepSeek's ue8m0 quantiser rounds up)."""
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / top)).clamp(-127, 127)
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> E4M3 codes and E8M0 scales ``[ceil(out/128), ceil(in/128)]``."""
    out, k = w.shape
    padded = torch.zeros(-(-out // 128) * 128, -(-k // 128) * 128)
    padded[:out, :k] = w
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale = _e8m0(blocks.abs().amax(dim=(1, 3)), 448.0)
    full = scale.float().repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[rows, K]`` -> int8 ``[rows, K/2]`` (nearest E2M1 code, the low nibble first) and E8M0 ``[rows, K/32]``."""
    rows, k = w.shape
    groups = w.view(rows, k // 32, 32)
    scale = _e8m0(groups.abs().amax(dim=-1), 6.0)
    codes = ((groups / scale.float()[..., None])[..., None] - E2M1).abs().argmin(dim=-1).view(rows, k).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), scale


def _published_name(name: str) -> str:
    for old, new in (("model.embed_tokens.weight", "embed.weight"), ("model.norm.weight", "norm.weight")):
        if name == old:
            return new
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name[len("model.hc_head.hc_"):]
    return name.removeprefix("model.")


def _config():
    """The tiny V4 of the parity tests, widened so that most linears have whole 128-wide FP8 blocks to keep."""
    config = tiny_config("deepseek_v4")
    config.hidden_size, config.q_lora_rank, config.o_lora_rank = 128, 128, 64
    return config


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(the published-layout directory, transformers on its dequantised weights, the dequantised tensors)."""
    import transformers as tf
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    root = tmp_path_factory.mktemp("deepseek_v4_published")
    build_tiny_model("deepseek_v4", root / "src", config=_config())
    state = load_file(root / "src" / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = _published_name(name)
        base = key.removesuffix(".weight")
        if any(base.endswith("." + lin) for lin in FP8_LINEARS):
            out[key], out[base + ".scale"] = _fp8_blocks(t.float())
        elif ".experts." in key:
            out[key], out[base + ".scale"] = _fp4(t.float())
        elif t.is_floating_point() and (key in ("embed.weight", "head.weight") or key.endswith("norm.weight")
                                        or key.endswith("gate.weight")):
            out[key] = t.to(torch.bfloat16)  # as published; the hyper-connection mixes, sinks and biases stay fp32
        else:
            out[key] = t
    # the multi-token-prediction layer: loaded past, in its own FP8 and FP4 forms
    out["mtp.0.e_proj.weight"], out["mtp.0.e_proj.scale"] = _fp8_blocks(torch.randn(128, 128))
    out["mtp.0.ffn.experts.0.w1.weight"], out["mtp.0.ffn.experts.0.w1.scale"] = _fp4(torch.randn(64, 128))
    dst = root / "published"
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    config = json.loads((root / "src" / "config.json").read_text())
    config.update(quantization_config=QUANT, expert_dtype="fp4")
    (dst / "config.json").write_text(json.dumps(config))

    # the reference: every (weight, scale) pair through transformers' dequantiser, back under transformers' names
    deq = Fp8Dequantize(None)
    ref_state = {}
    for name in state:
        key = _published_name(name)
        scale = out.get(key.removesuffix(".weight") + ".scale")
        ref_state[name] = (deq._dequantize_one(out[key], scale, torch.float32) if scale is not None
                           else out[key].float() if out[key].is_floating_point() else out[key])
    ref_dir = root / "reference"
    ref_dir.mkdir()
    save_file(ref_state, ref_dir / "model.safetensors")
    (ref_dir / "config.json").write_text((root / "src" / "config.json").read_text())
    reference = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    return dst, reference, ref_state


def test_the_published_names_scales_and_fp4_experts_are_read(published):
    """Every tensor but the MTP layer's maps to a weight moed reads; FP8 scales pair with their weights; the
    default bank keeps the FP4 experts (mxfp4) and the linears with whole 128-wide blocks stay FP8, each holding
    exactly what transformers' dequantiser makes of the checkpoint."""
    from moed.cache.bank_builder import dequantize_bank_rows

    path, _, ref_state = published
    ckpt = HfCheckpoint(path)
    assert ckpt.fp4_experts and ckpt.default_bank_dtype() == "mxfp4"
    assert "model.embed_tokens.weight" in ckpt.weight_keys and "lm_head.weight" in ckpt.weight_keys
    assert ckpt.weight_keys["model.hc_head.hc_fn"] == "model.hc_head.hc_fn"  # read from "hc_head_fn"
    assert not any(k.startswith("mtp.") or k.endswith("_scale_inv") for k in ckpt.weight_keys.values())
    loaded = load_model(path, cpu_only=True)
    assert loaded.bank.dtype == "mxfp4"
    packed = {n: w for n, w in loaded.weights.items() if isinstance(w, PackedLinear)}
    assert {w.dtype for w in packed.values()} == {"fp8"}
    for rel in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "attn.compressor.wkv",
                "ffn.shared_experts.w1"):  # every in-dimension of 128
        name = f"model.layers.1.{rel}.weight".replace("ffn.shared_experts.w1", "mlp.shared.gate_proj")
        if rel.startswith("attn.indexer"):
            name = name.replace("layers.1", "layers.0")
        assert name in packed, (name, sorted(packed))
    for name, w in packed.items():
        hf = name.replace("mlp.shared.gate_proj", "ffn.shared_experts.w1").replace(
            "mlp.shared.up_proj", "ffn.shared_experts.w3").replace("mlp.shared.down_proj", "ffn.shared_experts.w2")
        assert torch.equal(w.dequantize(torch.float32), ref_state[hf]), name
    wo_a = loaded.weights["model.layers.0.attn.wo_a.weight"]  # its 64-wide rows have no whole block: widened
    assert not isinstance(wo_a, PackedLinear) and torch.equal(wo_a.float(), ref_state["model.layers.0.attn.wo_a.weight"])
    gate_up, down = dequantize_bank_rows(loaded.bank.tensors, "mxfp4")
    e = loaded.bank.num_experts
    for layer in range(3):
        for x in range(e):
            p = f"model.layers.{layer}.ffn.experts.{x}."
            assert torch.equal(gate_up[layer * e + x], torch.cat([ref_state[p + "w1.weight"],
                                                                    ref_state[p + "w3.weight"]]).t())
            assert torch.equal(down[layer * e + x], ref_state[p + "w2.weight"].t())
    assert estimate_load(path, cpu_only=True).bank_bytes == loaded.bank.nbytes()


def test_the_published_checkpoint_matches_transformers(published):
    """Widened to float32 (exact: every FP8 and FP4 value is a float32 value) moed matches transformers at the
    usual tolerance, 8 greedy tokens equal. Kept as published (FP8 linears, FP4 experts, bf16 elsewhere), the
    torch path (activations rounded to bf16) is within 2% of the logits' range; the native kernels round
    activations to int8, which on this tiny model (weights scaled up) flips one token's expert choice in the
    last layer, so their check is the next token at each place of the prompt."""
    from moed.kernels.native_cpu import native
    from moed.runner.forward_batch import ForwardBatch

    path, reference, _ = published
    runtime = open_runtime(path, weights_dtype="fp32")
    try:
        assert runtime.loaded.bank.dtype == "mxfp4"
        with without_native_kernels():
            assert_matches_reference(runtime, reference, tol=1e-3, steps=8, what="deepseek_v4 published, fp32")
    finally:
        runtime.close()
    runtime = open_runtime(path)
    try:
        assert runtime.loaded.bank.dtype == "mxfp4"
        assert any(isinstance(w, PackedLinear) for w in runtime.loaded.weights.values())
        with without_native_kernels():
            assert_matches_reference(runtime, reference, tol=0.02, tokens_equal=False, steps=1,
                                     what="deepseek_v4 published, kept")
        if native() is not None:
            prompt = torch.randint(3, 500, (9,), generator=torch.Generator().manual_seed(2)).tolist()
            logits = runtime.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]),
                                           runtime.model.new_cache(1, 64), last_only=False)[0]
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0].argmax(-1)
            assert bool(torch.isfinite(logits).all())
            assert int((logits.argmax(-1) == want).sum()) >= 8, (logits.argmax(-1).tolist(), want.tolist())
    finally:
        runtime.close()


def test_broken_published_experts_are_clear_errors(published, tmp_path):
    """An FP4 expert without its scale, or of the wrong shape, names the tensor; nothing half-loads."""
    path, _, _ = published
    state = load_file(path / "model.safetensors")
    config = (path / "config.json").read_text()
    for case, edit in (("missing scale", lambda s: s.pop("layers.1.ffn.experts.3.w2.scale")),
                       ("wrong shape", lambda s: s.__setitem__("layers.1.ffn.experts.3.w2.weight",
                                                               torch.zeros(128, 16, dtype=torch.int8)))):
        bad = tmp_path / case.replace(" ", "_")
        bad.mkdir()
        broken = dict(state)
        edit(broken)
        save_file(broken, bad / "model.safetensors")
        (bad / "config.json").write_text(config)
        with pytest.raises(ModelFormatError, match=r"experts\.3\.w2"):
            load_model(bad, cpu_only=True)
