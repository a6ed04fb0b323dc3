"""The prepared device check of issue #13: parity, host syncs, decode by policy and VRAM cap, prefill.

    python benchmarks/gpu_check.py [--device cuda] [--layers 2] [--tokens 32] [--work DIR]

Made to run in one go on a machine with an NVIDIA GPU (benchmarks/gpu_check.sh wraps it with the
CUDA tests; <= 8 minutes). ``--device emulated`` runs the same steps on any machine (the smoke
test of this script; its decode figures are then this CPU's, not a GPU's). Prints markdown.

1. parity: 32 greedy tokens with every expert on the CPU against the device with the expert
   cache at 0 / 50 / 100% (adaptive), on tiny mixtral, qwen2_moe and deepseek_v3 models; the
   tokens must be identical, and the largest logit difference is reported.
2. host syncs per decode step on the bench model (the contract: one per MoE layer, plus one for
   the logits when the model is on the device).
3. decode tok/s on the bench model (Qwen3-30B-A3B-shaped layers: 128 experts x 768, hidden 2048,
   top-8) with the cache at 25% / 50% of the pool, for adaptive / fill-all / cpu-all.
4. prefill tok/s of a 1024-token prompt at the same settings (double-buffered prefill is not
   built yet: the figure is on-demand loading).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from moed.config import EngineConfig  # noqa: E402
from moed.engine.offline_run import run_offline  # noqa: E402
from moed.engine.runtime import open_runtime  # noqa: E402
from moed.engine.sampling import SamplingParams  # noqa: E402
from moed.runner.forward_batch import ForwardBatch  # noqa: E402

PARITY_FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
PARITY_STEPS = 32


def greedy(runtime, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    model = runtime.model
    cache = model.new_cache(1, len(prompt) + steps + 1)
    feed, start, tokens, logits_seen = prompt, 0, [], []
    for _ in range(steps):
        logits = model.forward(ForwardBatch.from_token_lists([feed], [start], [0]), cache)
        logits_seen.append(logits[0].float().cpu())
        start += len(feed)
        tokens.append(int(logits[0].argmax()))
        feed = [tokens[-1]]
    return tokens, logits_seen


def count_syncs(fn: Callable[[], None], device: str) -> "collections.Counter[str] | None":
    """Run ``fn`` under torch's CUDA sync debug mode; synchronizing calls counted by the moed code line
    that made them (the innermost frame in moed's package, with its caller). None on other devices."""
    if device != "cuda":
        fn()
        return None
    counts: collections.Counter[str] = collections.Counter()

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/moed/" in f.filename or "/daemon/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-2:][::-1]) or f"{filename}:{lineno}"
        counts[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return counts


def engine(device: str, **kw) -> EngineConfig:
    return EngineConfig(device=device, emulated_b_p=kw.pop("b_p", 16e9), **kw)


def parity(device: str, work: Path) -> bool:
    from helpers.tiny_models import build_tiny_model

    print("\n## 1. Greedy tokens, CPU vs device placement\n")
    print("| family | cache | tokens identical | max logit diff / max logit |")
    print("|---|---:|---|---:|")
    ok = True
    prompt = [5, 17, 42, 99, 7, 250, 31]
    for family in PARITY_FAMILIES:
        path = work / f"tiny-{family}"
        if not (path / "config.json").is_file():
            build_tiny_model(family, path)
        cpu = open_runtime(path, engine=EngineConfig(device="cpu"))
        try:
            want, want_logits = greedy(cpu, prompt, PARITY_STEPS)
        finally:
            cpu.close()
        for fraction in (0.0, 0.5, 1.0):
            rt = open_runtime(path, engine=engine(device, cache_fraction=fraction, policy="adaptive"))
            try:
                got, got_logits = greedy(rt, prompt, PARITY_STEPS)
            finally:
                rt.close()
            same = got == want
            diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want_logits, got_logits))
            ok &= same
            print(f"| {family} | {fraction:.0%} | {'yes' if same else 'NO'} | {diff:.1e} |")
    return ok


def bench_model(work: Path, layers: int) -> Path:
    from helpers.synthetic_checkpoint import write_qwen3_moe_checkpoint

    path = work / f"bench-{layers}"
    if not (path / "config.json").is_file():
        write_qwen3_moe_checkpoint(path, num_layers=layers)
    return path


def syncs_per_step(device: str, model: Path, tokens: int) -> None:
    print("\n## 2. Host syncs per decode step (bench model)\n")
    rt = open_runtime(model, engine=engine(device, cache_fraction=0.5, policy="adaptive"))
    try:
        dev = getattr(rt.executor, "device", None)
        if dev is None:
            print(f"the engine fell back to the CPU backend (pinning: {rt.executor.stats.pin_note}): no device syncs")
            return
        moe_layers = rt.executor.bank.num_moe_layers
        cache = rt.model.new_cache(1, tokens + 16)
        logits = rt.model.forward(ForwardBatch.from_token_lists([[11, 12, 13, 14]], [0], [0]), cache)
        before = dev.stats().host_syncs

        def decode() -> None:
            nonlocal logits
            for step in range(tokens):
                logits = rt.model.forward(ForwardBatch.from_token_lists([[int(logits[0].argmax())]], [4 + step],
                                                                        [0]), cache)

        flagged = count_syncs(decode, device)
        per_step = (dev.stats().host_syncs - before) / tokens
        on_device = rt.model.device is not None
        expect = moe_layers + 1 if on_device else moe_layers
        print(f"{per_step:.2f} host syncs per decode step over {tokens} steps; {moe_layers} MoE layers; model on "
              f"the {'device' if on_device else 'host'} (expected {expect}: one per MoE layer"
              f"{' and one for the logits' if on_device else ''}){'' if on_device else ': ' + rt.executor.stats.model_note}")
        if flagged is not None:
            print(f"\ntorch sync debug mode: {sum(flagged.values()) / tokens:.2f} synchronizing calls per step, by place:")
            for where, n in flagged.most_common(12):
                print(f"- {n / tokens:.2f}/step at {where}")
    finally:
        rt.close()


def decode_and_prefill(device: str, model: Path, tokens: int) -> None:
    print("\n## 3-4. Decode and prefill on the bench model, by policy and cache size\n")
    print("| cache | policy | decode tok/s | prefill tok/s (1024) | hits | fills | cpu | modelled MoE ms/token | B_P GB/s | B_H GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    prompt = [(7 * i + 11) % 40000 + 50 for i in range(1024)]
    for fraction in (0.25, 0.5):
        for policy in ("adaptive", "fill-all", "cpu-all"):
            rt = open_runtime(model, engine=engine(device, cache_fraction=fraction, policy=policy))
            try:
                run_offline(rt, [prompt[:8]], [SamplingParams(max_tokens=2, ignore_eos=True)], context_length=64)
                (pre,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=1, ignore_eos=True)],
                                     context_length=len(prompt) + 8)
                prefill = len(prompt) / pre.usage.ttft_s
                s0 = rt.executor.stats.modelled_seconds
                (dec,) = run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=tokens + 1, ignore_eos=True)],
                                     context_length=tokens + 32)
                s = rt.executor.stats
                modelled = (s.modelled_seconds - s0) / max(len(dec.token_ids), 1) * 1e3
                print(f"| {fraction:.0%} | {policy} | {dec.usage.decode_tok_s:.1f} | {prefill:.0f} | {s.hits} | "
                      f"{s.fills + s.transient_fills} | {s.cpu_experts} | {modelled:.1f} | {s.b_p / 1e9:.1f} | "
                      f"{s.b_h / 1e9:.1f} |")
            finally:
                rt.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "emulated"))
    ap.add_argument("--layers", type=int, default=2, help="layers of the bench model")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per measurement")
    ap.add_argument("--work", default=None, help="where the models are built (default: a temporary folder)")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: parity,syncs,decode")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device emulated for the smoke test", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="moed-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "emulated device"
    print(f"# moed device check: {name}, torch {torch.__version__}")
    ok = True
    if "parity" not in skip:
        ok = parity(args.device, work)
    if not skip >= {"syncs", "decode"}:
        model = bench_model(work, args.layers)
        if "syncs" not in skip:
            syncs_per_step(args.device, model, args.tokens)
        if "decode" not in skip:
            decode_and_prefill(args.device, model, args.tokens)
    print(f"\nparity: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
