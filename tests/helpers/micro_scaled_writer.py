"""Tiny NVFP4 / MXFP8 checkpoints written by the reference library, compressed-tensors (llm-compressor's
format), and their reference dequantisation by the same library.

compressed-tensors quantises ``nn.Linear`` modules, and transformers holds a MoE layer's experts as
fused 3-D parameters while ``save_pretrained`` writes them one Linear per expert; so the writer
rebuilds a module tree of ``nn.Linear`` from the saved state dict, applies the preset scheme
(``NVFP4A16`` / ``MXFP8A16``) to every Linear but ``lm_head`` and the routers, calibrates the
weights as llm-compressor does for weight-only schemes (per-tensor global scale from the absolute
maximum, shared between gate/up and q/k/v, then per-group scales from a min-max observer) and lets
the library compress and save the model and write ``quantization_config``.

``write_modelopt_nvfp4`` rewrites such an NVFP4 checkpoint in NVIDIA ModelOpt's layout (the inverse
of compressed-tensors' own ModelOpt converter: ``weight_packed`` -> ``weight``, ``weight_scale_2 =
1 / weight_global_scale``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SCHEMES = ("NVFP4A16", "MXFP8A16")
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def _module_tree(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose parameters are ``state``'s, with an ``nn.Linear`` for every 2-D ``*_proj``,
    ``lm_head`` and router weight (what compressed-tensors can target)."""
    root = torch.nn.Module()

    def container(path: list[str]) -> torch.nn.Module:
        mod = root
        for part in path:
            if getattr(mod, part, None) is None:
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        return mod

    for key, t in state.items():
        *path, pname = key.split(".")
        leaf = path[-1] if path else ""
        if pname == "weight" and t.dim() == 2 and (leaf.endswith("_proj") or leaf == "lm_head"
                                                    or (leaf == "gate" and path[-2] == "mlp")):
            linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
            linear.weight.data = t.clone()
            parent = container(path[:-1])
            before = getattr(parent, leaf, None)  # a module made for a tensor beside this one (a router's bias)
            for pname_before, p in ([] if before is None else list(before.named_parameters(recurse=False))):
                linear.register_parameter(pname_before, p)
            parent.add_module(leaf, linear)
        else:
            container(path).register_parameter(pname, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


@torch.no_grad()
def _calibrate(model: torch.nn.Module) -> None:
    from compressed_tensors.quantization import QuantizationStatus, QuantizationStrategy
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    quantised = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    for m in quantised.values():
        if m.quantization_scheme.weights.strategy == QuantizationStrategy.TENSOR_GROUP:
            m.weight_global_scale.data.copy_(generate_gparam(m.weight.amin(), m.weight.amax()))
    shared: dict[str, list[torch.nn.Module]] = {}
    for n, m in quantised.items():
        parent, leaf = n.rsplit(".", 1)
        if hasattr(m, "weight_global_scale") and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            shared.setdefault(parent + (":qkv" if leaf.endswith(("q_proj", "k_proj", "v_proj")) else ":gu"), []).append(m)
    for mods in shared.values():
        g = torch.min(torch.cat([m.weight_global_scale.data for m in mods]))
        for m in mods:
            m.weight_global_scale.data.fill_(g)
    for m in quantised.values():
        args = m.quantization_scheme.weights
        scale, zp = compute_dynamic_scales_and_zp(m.weight, args, m, global_scale=getattr(m, "weight_global_scale", None))
        m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp.to(m.weight_zero_point.dtype))
        m.quantization_status = QuantizationStatus.FROZEN


def write_compressed_tensors(src: Path, dst: Path, scheme: str) -> Path:
    """``dst``: the Hugging Face checkpoint at ``src`` (config.json + model.safetensors) quantised to
    ``scheme`` and saved by compressed-tensors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    dst.mkdir(parents=True, exist_ok=True)
    model = _module_tree(load_file(src / "model.safetensors"))
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"],
                                                                             **PRESET_SCHEMES[scheme])},
                                ignore=IGNORE)
    apply_quantization_config(model, config, show_progress=False)
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    compressor.update_config(str(dst))
    return dst


def dequantised_reference(path: Path, dst: Path, like: Path) -> Path:
    """``dst``: the checkpoint at ``path`` dequantised to float32 by compressed-tensors' own ``dequantize``
    (its on-disk dequantiser rounds to bf16), with ``like``'s (unquantised) config.json, for
    transformers to load as the reference."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(path / "model.safetensors")
    quant = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    args = quant.config_groups["group_0"].weights
    plain = {}
    for key, value in state.items():
        module, _, part = key.rpartition(".")
        if part == "weight_packed":
            n, half = value.shape
            codes = unpack_fp4_from_uint8(value, n, 2 * half, dtype=torch.float32)
            plain[f"{module}.weight"] = dequantize(codes, state[f"{module}.weight_scale"].float(), args=args,
                                                   global_scale=state[f"{module}.weight_global_scale"],
                                                   dtype=torch.float32)
        elif part == "weight" and value.dtype == torch.float8_e4m3fn:
            plain[key] = dequantize(value, torch.exp2(state[f"{module}.weight_scale"].float() - 127), args=args,
                                    dtype=torch.float32)
        elif part not in ("weight_scale", "weight_global_scale"):
            plain[key] = value.float()
    save_file({k: v.contiguous() for k, v in plain.items()}, dst / "model.safetensors")
    shutil.copy(like / "config.json", dst / "config.json")
    return dst


def write_modelopt_nvfp4(ct_nvfp4: Path, dst: Path) -> Path:
    """``dst``: a compressed-tensors NVFP4 checkpoint in ModelOpt's layout and config (both the config.json
    entry and hf_quant_config.json, as ModelOpt exports write them)."""
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, value in load_file(ct_nvfp4 / "model.safetensors").items():
        module, _, part = key.rpartition(".")
        if part == "weight_packed":
            out[f"{module}.weight"] = value
        elif part == "weight_global_scale":
            out[f"{module}.weight_scale_2"] = (1.0 / value.float()).reshape(())
            out[f"{module}.input_scale"] = torch.ones((), dtype=torch.float32)
        else:
            out[key] = value
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ct_nvfp4 / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ignore}
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    return dst
