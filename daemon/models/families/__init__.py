"""The supported model families: how each one's config.json and checkpoint names map onto moed's model.

Every family shares one decoder-layer shape (norm, attention, norm, MLP-or-MoE); what differs is parsed by
the family's module into a ``ModelConfig`` and a ``FamilyNames`` table (``base.Family``). Canonical tensor
names (used inside moed and in FTW files) are the Hugging Face ones for embeddings, norms and attention;
MoE parts are renamed to ``model.layers.{i}.mlp.router.*``, ``...mlp.shared.*`` so the runtime needs no
per-family branches. A new family is one module here listed in ``MODULES`` (docs/architecture.md, "Adding
a family").
"""

from __future__ import annotations

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.models.families import (deepseek, deepseek_v4, ernie, gemma4, glm, gpt_oss, kimi_linear, llama4, minimax,
                                  mixtral, nemotron_h, olmoe, qwen_moe, qwen_next)
from moed.models.families.base import Family, FamilyNames
from moed.models.model_config import ModelConfig


MODULES = (mixtral, qwen_moe, olmoe, deepseek, deepseek_v4, gpt_oss, glm, qwen_next, ernie, minimax, llama4,
           nemotron_h, gemma4, kimi_linear)


FAMILIES: dict[str, Family] = {family.name: family for module in MODULES for family in module.FAMILIES}


ARCHITECTURES: dict[str, str] = {arch: family.name for family in FAMILIES.values() for arch in family.architectures}


def family_of(cfg: dict, *, where: str = "config.json") -> Family:
    """Pick the family from ``model_type`` (or ``architectures``), or say which ones exist."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        for arch in cfg.get("architectures") or []:
            if arch in ARCHITECTURES:
                model_type = ARCHITECTURES[arch]
                break
    if model_type not in FAMILIES:
        shown = model_type or (cfg.get("architectures") or ["<none>"])[0]
        raise UnsupportedModelError(
            f"{where}: architecture {shown!r} is not supported. Supported: "
            + ", ".join(f"{arch} ({mt})" for arch, mt in ARCHITECTURES.items())
        )
    return FAMILIES[model_type]


def parse_model_config(cfg: dict, *, where: str = "config.json") -> ModelConfig:
    family = family_of(cfg, where=where)
    cfg = dict(cfg, model_type=family.name)
    try:
        return family.parse(cfg)
    except ModelFormatError as exc:
        if where != "config.json":
            raise ModelFormatError(str(exc).replace("config.json", where, 1)) from None
        raise


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "FamilyNames", "MODULES", "family_of", "parse_model_config"]
