"""Real-shape figures on a GPU (issue #32): a Qwen3-30B-A3B-shaped model built in memory, all policies.

    python benchmarks/gpu_real_shape.py [--device cuda] [--experts-dtype int4] [--caps 4,8,16]
        [--tokens 32] [--prefill 4096,16384] [--sections decode,syncs,prefill,pressure] [--json FILE]

The bench model has Qwen3-30B-A3B's shape at full depth (48 layers, 128 experts x 768, hidden
2048, top-8, 32 q / 4 kv heads x 128) with random weights generated on the device (bf16
non-expert weights there, the expert bank in host RAM in the chosen dtype, pinned once) — no
files, so it builds in seconds where a 30B checkpoint would take minutes to write and convert.

1. decode: greedy tokens and tok/s with the VRAM budget capped at each ``--caps`` GiB (weights,
   KV and a reserve come first, the rest is the expert cache) for adaptive, fill-all and the
   static placement of whole last layers (llama.cpp's ``--n-cpu-moe``), plus cpu-all (every
   expert on the CPU; it does not depend on the cap); tokens must equal cpu-all's. The
   measured B_P (pinned copies alone) and the engine's B_P / B_H and last q/m are reported.
2. syncs: host syncs per decode step counted by the device and by torch's sync debug mode.
3. prefill: 4k / 16k-token prompts with double buffering on and off against the PCIe bound
   (chunks x pool bytes / B_P).
4. pressure: another process takes VRAM during a decode; NVML readings shrink the budget; the
   cache resizes at a safe point; tokens must not change.

``--device emulated`` with small ``--layers/--hidden/...`` is this script's CPU smoke test.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import count_syncs  # noqa: E402
from moed.cache.bank_builder import bank_tensor_specs  # noqa: E402
from moed.cache.host_bank import GGML_BANK, ExpertActivation, ExpertBank  # noqa: E402
from moed.config import EngineConfig  # noqa: E402
from moed.engine.offline_run import run_offline  # noqa: E402
from moed.engine.runtime import ModelRuntime  # noqa: E402
from moed.engine.sampling import SamplingParams  # noqa: E402
from moed.experts.cpu_pool import CpuWorkerPool  # noqa: E402
from moed.experts.engine_stats import EngineStats  # noqa: E402
from moed.experts.device_ffn import copy_experts, slot_layout_of  # noqa: E402
from moed.devices.device import slot_nbytes  # noqa: E402
from moed.experts.executor_factory import initial_bandwidth, select_device  # noqa: E402
from moed.experts.kernel_bench import random_rows  # noqa: E402
from moed.kernels.gguf_quants import type_id  # noqa: E402
from moed.experts.hybrid_executor import HybridExecutor  # noqa: E402
from moed.experts.policies import make_policy  # noqa: E402
from moed.models.families import parse_model_config  # noqa: E402
from moed.models.moe_transformer import MoeTransformer  # noqa: E402
from moed.models.weight_spec import expected_weight_shapes  # noqa: E402
from moed.runner.forward_batch import ForwardBatch  # noqa: E402
from moed.weights.model_loader import LoadedModel  # noqa: E402

GiB = 1 << 30
DECODE_CONTEXT = 512
# A random-weight model decoded greedily repeats one token, so its routing repeats and every cache
# looks perfect. Decode samples instead (temperature 1, fixed seed: the same draws whatever the
# placement, so the tokens must still match cpu-all's): the routing then varies from token to token.
def sampled(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=17, max_tokens=max_tokens, ignore_eos=True)

POLICIES = ("adaptive", "fill-all", "static-layers")
GGML_Q4_K_M = "ggml-q4_k_m"


class Bench:
    """The in-memory bench model: config, device weights, pinned host bank, the device."""

    def __init__(self, args) -> None:
        from helpers.synthetic_checkpoint import qwen3_moe_config

        self.args = args
        sizes = dict(num_layers=args.layers, hidden=args.hidden, num_experts=args.experts,
                     moe_intermediate=args.inter, num_heads=args.heads, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim, vocab=args.vocab)
        cfg = qwen3_moe_config(top_k=args.top_k, **sizes).to_dict()
        cfg["max_position_embeddings"] = 65536
        self.config = parse_model_config(cfg, where="bench model")
        self.device = select_device(args.device, b_p=args.emulated_bp * 1e9)
        dev = self.device.compute_device
        t0 = time.perf_counter()
        gen = torch.Generator(device=dev).manual_seed(1234)
        self.weights = {}
        for name, shape in expected_weight_shapes(self.config).items():  # the non-expert weights
            if name.endswith("norm.weight"):
                self.weights[name] = torch.ones(shape, dtype=torch.bfloat16, device=dev)
            else:
                self.weights[name] = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.weights.values())
        self.bank = self._bank(gen)
        self.build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.pin = self.device.pin_host(self.bank.storage())
        self.pin_s = time.perf_counter() - t0
        self.kv_per_token = 2 * self.config.num_layers * args.kv_heads * args.head_dim * 2  # bf16 K and V

    def _bank(self, gen: torch.Generator) -> ExpertBank:
        a, dtype = self.args, self.args.experts_dtype
        if dtype == GGML_Q4_K_M:
            return self._q4_k_m_bank(gen)
        n = a.layers * a.experts
        specs = bank_tensor_specs(dtype, n, a.hidden, a.inter, False)
        dev = self.device.compute_device
        tensors = {name: torch.empty(shape, dtype=dt) for name, (shape, dt) in specs.items()}
        for layer in range(a.layers):
            rows = slice(layer * a.experts, (layer + 1) * a.experts)
            for name, t in tensors.items():
                shape = (a.experts, *t.shape[1:])
                if t.dtype == torch.uint8:  # int4 / mxfp4 nibbles, or e8m0 exponents
                    if name.endswith(".e8m0"):
                        v = torch.randint(118, 122, shape, generator=gen, device=dev, dtype=torch.uint8)
                    else:
                        v = torch.randint(0, 256, shape, generator=gen, device=dev, dtype=torch.uint8)
                elif t.dtype == torch.int8:  # q8
                    v = torch.randint(-127, 128, shape, generator=gen, device=dev, dtype=torch.int8)
                elif name.endswith(".min"):  # int4: w = q * scale + min, centred on 0
                    scale = tensors[name[:-4] + ".scale"][rows]
                    v = (scale.float() * -7.5).to(t.dtype)
                    t[rows].copy_(v)
                    continue
                elif name.endswith(".scale"):  # int4 scale: weights of std ~0.02
                    v = (0.004 + 0.002 * torch.rand(shape, generator=gen, device=dev)).to(t.dtype)
                else:  # q8 block scales
                    v = (0.0002 + 0.0002 * torch.rand(shape, generator=gen, device=dev)).to(t.dtype)
                t[rows].copy_(v.cpu() if v.device.type != "cpu" else v)
        return ExpertBank(num_moe_layers=a.layers, num_experts=a.experts, hidden_size=a.hidden,
                          intermediate_size=a.inter, dtype=dtype, activation=ExpertActivation("silu"),
                          tensors=tensors)

    def _q4_k_m_bank(self, gen: torch.Generator) -> ExpertBank:
        """The ggml bank of a Q4_K_M file (random valid blocks): Q4_K gate/up, the down Q6_K in llama.cpp's
        "more bits" layers (the first and last eighth and every third between) and Q4_K in the others."""
        a = self.args
        n = a.layers
        tensors, types = {}, {}
        for layer in range(n):
            more = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
            for kind, name, rows, k in (("gate", "Q4_K", a.inter, a.hidden), ("up", "Q4_K", a.inter, a.hidden),
                                        ("down", "Q6_K" if more else "Q4_K", a.hidden, a.inter)):
                # fp16 block scales of 1e-4: weights of a few hundredths, as the int4 bank's
                tensors[f"{kind}.{layer}"] = random_rows(name, (a.experts, rows), k, gen, scale=1e-4)
                types[f"{kind}.{layer}"] = type_id(name)
        return ExpertBank(num_moe_layers=n, num_experts=a.experts, hidden_size=a.hidden, intermediate_size=a.inter,
                          dtype=GGML_BANK, activation=ExpertActivation("silu"), tensors=tensors, row_types=types)

    def slots_for(self, cap_bytes: int, context: int = 2 * DECODE_CONTEXT) -> int:
        room = cap_bytes - self.weight_bytes - context * self.kv_per_token - self.args.reserve_mib * (1 << 20)
        return max(0, min(self.bank.num_slots, room // slot_nbytes(slot_layout_of(self.bank))))

    def runtime(self, policy: str, num_slots: int, prefill_buffers: int = 2) -> ModelRuntime:
        name, opts = ("static", {"layout": "layers"}) if policy == "static-layers" else (policy, {})
        cfg = EngineConfig(device=self.args.device, emulated_b_p=self.args.emulated_bp * 1e9)
        executor = HybridExecutor(self.bank, self.device, num_slots=num_slots, policy=make_policy(name, **opts),
                                  bandwidth=initial_bandwidth(self.device.kind, self.bank, cfg),
                                  cpu_pool=CpuWorkerPool(None), stats=EngineStats(device=self.device.kind, policy=policy),
                                  prefill_buffers=prefill_buffers)
        model = MoeTransformer(self.config, self.weights, executor, where="bench model", device=self.device)
        executor.model_on_device = True
        loaded = LoadedModel(Path("bench-model"), "ftw", self.config, model.weights, self.bank)
        return ModelRuntime(loaded, model, executor, None)

    def prompt(self, n: int, seed: int) -> list[int]:
        return [(seed * 7919 + 104729 * i) % (self.args.vocab - 100) + 50 for i in range(n)]


def measure_b_p(bench: Bench) -> float:
    """Pinned host -> device copies alone: 256 contiguous bank rows (best of 3)."""
    dev, bank = bench.device, bench.bank
    n = min(256, bank.num_slots)
    slots = dev.alloc_slots(n, slot_layout_of(bank))
    best = 0.0
    try:
        for _ in range(3):
            handles = copy_experts(dev, slots, list(range(n)), bank, list(range(n)))
            for h in handles:
                h.wait()
            best = max(best, sum(h.nbytes for h in handles) / max(sum(h.seconds for h in handles), 1e-9))
    finally:
        dev.free_slots(slots)
    return best


def delta(after: EngineStats, before: EngineStats) -> dict:
    return {k: getattr(after, k) - getattr(before, k) for k in ("hits", "misses", "fills", "transient_fills",
                                                               "cpu_experts", "streamed_bytes", "copy_seconds")}


def decode_run(bench: Bench, policy: str, slots: int, tokens: int) -> dict:
    rt = bench.runtime(policy, slots)
    try:
        warm = bench.prompt(48, 1)  # < 64 tokens: the split path, so caches and static sets warm up
        run_offline(rt, [warm], [sampled(8)], context_length=DECODE_CONTEXT)
        before = copy.copy(rt.executor.stats)
        (res,) = run_offline(rt, [bench.prompt(16, 2)], [sampled(tokens)], context_length=DECODE_CONTEXT)
        s = rt.executor.stats
        d = delta(s, before)
        return dict(policy=policy, slots=rt.executor.stats.cache_slots, tok_s=res.usage.decode_tok_s,
                    tokens=list(res.token_ids), finish=res.finish_reason, error=res.error,
                    miss_rate=d["misses"] / max(d["hits"] + d["misses"], 1), fills=d["fills"] + d["transient_fills"],
                    cpu=d["cpu_experts"], hits=d["hits"], b_p=s.b_p, b_h=s.b_h, last_q=s.last_q, last_m=s.last_m)
    finally:
        rt.close()


def section_decode(bench: Bench, out: dict) -> bool:
    args = bench.args
    print("\n## 1. Decode by VRAM cap and placement (sampled with a fixed seed, tokens checked against cpu-all)\n")
    ref = decode_run(bench, "cpu-all", 0, args.tokens)
    out["cpu_all"] = ref
    print(f"cpu-all (every expert on the CPU, cap-independent): {ref['tok_s']:.1f} tok/s; engine B_H "
          f"{ref['b_h'] / 1e9:.1f} GB/s; finish {ref['finish']} {ref['error']}\n")
    print("| VRAM cap | cache slots (% of pool) | policy | decode tok/s | vs cpu-all | miss rate | fills | cpu | "
          "tokens = cpu-all | B_P GB/s | B_H GB/s | last q/m |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    ok = True
    rows = []
    for cap in args.caps:
        slots = bench.slots_for(int(cap * GiB))
        per_cap = {}
        for policy in POLICIES:
            try:
                r = decode_run(bench, policy, slots, args.tokens)
            except Exception:
                traceback.print_exc()
                print(f"| {cap:g} GiB | {slots} | {policy} | FAILED | | | | | | | | |")
                ok = False
                continue
            same = r["tokens"] == ref["tokens"]
            ok &= same
            per_cap[policy] = r
            rows.append(dict(cap_gib=cap, **r))
            print(f"| {cap:g} GiB | {slots} ({slots / bench.bank.num_slots:.0%}) | {policy} | {r['tok_s']:.1f} | "
                  f"{r['tok_s'] / max(ref['tok_s'], 1e-9):.2f}x | {r['miss_rate']:.0%} | {r['fills']} | {r['cpu']} | "
                  f"{'yes' if same else 'NO'} | {r['b_p'] / 1e9:.1f} | {r['b_h'] / 1e9:.1f} | {r['last_q']}/{r['last_m']} |")
        if "adaptive" in per_cap:
            best = max([ref["tok_s"]] + [per_cap[p]["tok_s"] for p in ("fill-all", "static-layers") if p in per_cap])
            static = per_cap.get("static-layers", {}).get("tok_s", 0.0)
            a = per_cap["adaptive"]["tok_s"]
            print(f"|  |  | adaptive / best other | {a / best:.2f}x | adaptive / static {a / max(static, 1e-9):.2f}x "
                  f"| | | | | | | |")
    out["decode"] = rows
    return ok


def section_parity(bench: Bench, out: dict) -> bool:
    """Logits along one fixed token stream (teacher forcing) for every placement at the smallest cap,
    against cpu-all: the placement-invariance check that near-ties cannot blur (a random-weight model's
    distributions are nearly flat, so a sampled draw can flip on a 1e-6 difference)."""
    cap = min(bench.args.caps)
    slots = bench.slots_for(int(cap * GiB))
    prompt, stream = bench.prompt(16, 8), bench.prompt(32, 9)
    print(f"\n## 0. Placement invariance: logits along a fixed {len(stream)}-token stream, {cap:g} GiB cap, "
          f"against cpu-all\n")
    logits_of = {}
    for policy in ("cpu-all",) + POLICIES:
        rt = bench.runtime(policy, 0 if policy == "cpu-all" else slots)
        try:
            cache = rt.model.new_cache(1, 64)
            seen = [rt.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]), cache)[0].float().cpu()]
            for i, tok in enumerate(stream):
                seen.append(rt.model.forward(ForwardBatch.from_token_lists([[tok]], [len(prompt) + i], [0]),
                                             cache)[0].float().cpu())
            logits_of[policy] = (seen, copy.copy(rt.executor.stats))
        finally:
            rt.close()
    ref = logits_of["cpu-all"][0]
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in ref]
    print(f"cpu-all: smallest top-1/top-2 logit gap over the stream {min(gaps):.2e} (logit scale "
          f"{max(float(v.abs().max()) for v in ref):.2f})\n")
    print("| policy | fills | cpu | max logit diff / max logit | argmax equal |")
    print("|---|---:|---:|---:|---:|")
    ok = True
    rows = []
    for policy in POLICIES:
        seen, s = logits_of[policy]
        diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(ref, seen))
        same = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(ref, seen))
        ok &= same == len(ref) and diff < 1e-4
        rows.append(dict(policy=policy, diff=diff, argmax_equal=same, steps=len(ref)))
        print(f"| {policy} | {s.fills + s.transient_fills} | {s.cpu_experts} | {diff:.1e} | {same}/{len(ref)} |")
    out["parity"] = rows
    return ok


def section_syncs(bench: Bench, out: dict) -> None:
    print("\n## 2. Host syncs per decode step (adaptive, middle cap)\n")
    cap = bench.args.caps[len(bench.args.caps) // 2]
    rt = bench.runtime("adaptive", bench.slots_for(int(cap * GiB)))
    try:
        model, dev = rt.model, rt.executor.device
        steps = 8
        cache = model.new_cache(1, 64)
        logits = model.forward(ForwardBatch.from_token_lists([bench.prompt(8, 3)], [0], [0]), cache)
        tok = int(logits[0].argmax())
        for i in range(2):  # warm: kernels compiled, allocator settled
            logits = model.forward(ForwardBatch.from_token_lists([[tok]], [8 + i], [0]), cache)
            tok = int(logits[0].argmax())
        before = dev.stats().host_syncs

        def decode() -> None:
            nonlocal tok, logits
            for i in range(steps):
                logits = model.forward(ForwardBatch.from_token_lists([[tok]], [10 + i], [0]), cache)
                tok = int(logits[0].argmax())  # logits are host tensors: no sync here

        flagged = count_syncs(decode, bench.args.device)
        per_step = (dev.stats().host_syncs - before) / steps
        layers = bench.bank.num_moe_layers
        print(f"device-counted host syncs per step: {per_step:.2f} (expected {layers + 1}: one per MoE layer + logits)")
        if flagged is not None:
            total = sum(flagged.values())
            print(f"torch sync debug mode: {total / steps:.2f} flagged synchronizing calls per step; by place:")
            for where, n in flagged.most_common(12):
                print(f"- {n / steps:.2f}/step at {where}")
            out["syncs"] = dict(per_step=per_step, flagged_per_step=total / steps,
                                places={k: v / steps for k, v in flagged.items()})
        else:
            out["syncs"] = dict(per_step=per_step)
    finally:
        rt.close()


def section_prefill(bench: Bench, out: dict, b_p_alone: float) -> None:
    args = bench.args
    cap = args.caps[len(args.caps) // 2]
    pool = bench.bank.nbytes()
    print(f"\n## 3. Prefill, adaptive at the {cap:g} GiB cap: double-buffered vs on-demand layer loads\n")
    print(f"expert pool {pool / 1e9:.2f} GB; pinned copies alone B_P {b_p_alone / 1e9:.1f} GB/s; "
          f"prefill chunk {4096} tokens: each chunk streams the pool once\n")
    print("| prompt tokens | buffers | TTFT s | tok/s | PCIe bound s | bound / TTFT | streamed GB | link busy s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n in args.prefill:
        for buffers in (2, 1):
            context = n + 16
            slots = bench.slots_for(int(cap * GiB), context=2 * context)
            rt = bench.runtime("adaptive", max(slots, 2 * bench.bank.num_experts), prefill_buffers=buffers)
            try:
                run_offline(rt, [bench.prompt(128, 4)], [SamplingParams(max_tokens=1, ignore_eos=True)],
                            context_length=256)  # kernels warm
                before = copy.copy(rt.executor.stats)
                (res,) = run_offline(rt, [bench.prompt(n, 5)], [SamplingParams(max_tokens=1, ignore_eos=True)],
                                     context_length=context)
                d = delta(rt.executor.stats, before)
            except Exception:
                traceback.print_exc()
                print(f"| {n} | {buffers} | FAILED | | | | | |")
                continue
            finally:
                rt.close()
            chunks = -(-n // 4096)
            bound = chunks * pool / b_p_alone if b_p_alone else 0.0
            ttft = res.usage.ttft_s
            rows.append(dict(tokens=n, buffers=buffers, ttft_s=ttft, bound_s=bound, streamed=d["streamed_bytes"],
                             link_s=d["copy_seconds"], error=res.error))
            print(f"| {n} | {buffers} | {ttft:.2f} | {n / ttft:.0f} | {bound:.2f} | {bound / ttft:.2f} | "
                  f"{d['streamed_bytes'] / 1e9:.1f} | {d['copy_seconds']:.2f} |")
    out["prefill"] = rows


PRESSURE_CHILD = (
    "import sys, time, torch\n"
    "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize(); print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def section_pressure(bench: Bench, out: dict) -> bool:
    """Another process takes nearly all free VRAM mid-decode and lets it go 3 s later; the governor
    (NVML readings, 8 GiB headroom kept free for other apps) shrinks the budget, the manager resizes
    the cache at the loop's next safe point, and grows it back once the memory is free again. The
    tokens must equal an unpressured run's and the request must finish."""
    from moed.engine.engine_loop import EngineLoop
    from moed.engine.model_manager import LoadedEntry, LoadOptions, ModelManager
    from moed.engine.request import GenerationRequest
    from moed.service.memory_governor import GovernorConfig, MemoryGovernor
    from moed.service.memory_source import NvmlSource, SimulatedSource

    args = bench.args
    cap = max(args.caps)
    tokens = max(64, args.tokens * 2)
    print(f"\n## 4. Cache resize under NVML pressure during decode ({cap:g} GiB cap, 8 GiB headroom; another process "
          f"takes all but 1 GiB of the free VRAM for 3 s)\n")
    on_cuda = args.device == "cuda"
    if on_cuda and not NvmlSource.available():
        print("NVML is not usable here: skipped")
        return True
    rt = bench.runtime("adaptive", bench.slots_for(int(cap * GiB)))
    manager = ModelManager([])
    headroom = 8 * GiB if on_cuda else int(cap * GiB) // 2
    # the emulated smoke test: a simulated GPU of three caps whose "other apps" the same steps move
    simulated = None if on_cuda else SimulatedSource(3 * int(cap * GiB))
    governor = MemoryGovernor(NvmlSource() if on_cuda else simulated,
                              GovernorConfig(poll_interval_s=0.05, headroom_bytes=headroom, grow_after_s=1.0,
                                             **({} if on_cuda else dict(shrink_tolerance_bytes=0,
                                                                        grow_hysteresis_bytes=0))),
                              user_cap_bytes=int(cap * GiB))
    reserved = torch.cuda.memory_reserved if on_cuda else (lambda: rt.executor.stats.cache_bytes + bench.weight_bytes)
    child = None
    try:
        prompt = bench.prompt(16, 6)
        (ref,) = run_offline(rt, [prompt], [sampled(tokens)], context_length=DECODE_CONTEXT)
        loop = EngineLoop(rt, name="bench", max_batch=1, context_length=DECODE_CONTEXT)
        entry = LoadedEntry("bench", Path("bench-model"), rt, loop, LoadOptions(device="cuda", cache_fraction=1.0))
        manager._models["bench"] = entry
        governor.set_ours(reserved())
        started = time.perf_counter()
        budgets = []
        governor.on_budget(lambda b: (budgets.append((round(time.perf_counter() - started, 2), b)),
                                      manager.apply_cache_budget(b)))
        manager.apply_cache_budget(governor.budget())
        loop.start()
        seen = []
        handle = loop.submit(GenerationRequest("pressure", list(prompt), sampled(tokens)))
        governor.start()
        got, final = [], None
        for event in handle.events():
            got.extend(event.token_ids)
            seen.append(rt.executor.stats.cache_slots)
            governor.set_ours(reserved())
            if len(got) == 8 and child is None and on_cuda:
                free, _ = torch.cuda.mem_get_info()
                take = max(0, free - GiB)
                child = subprocess.Popen([sys.executable, "-c", PRESSURE_CHILD, str(take), "3"],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                held = child.stdout.readline().strip()
                print(f"after {len(got)} tokens: another process asked for {take / GiB:.1f} GiB ({held or 'no reply'})")
            elif len(got) == 8 and child is None:
                ours = reserved()
                simulated.set_other_apps(3 * int(cap * GiB) - ours - int(cap * GiB) // 8)
                child = threading.Timer(3.0, lambda: simulated.set_other_apps(0))
                child.start()
                print(f"after {len(got)} tokens: simulated other apps take all but {cap / 8:g} GiB")
            if event.done:
                final = event
                break
        loop.stop()
        same = got == ref.token_ids
        low = min(seen)
        print(f"budget changes (s after start, GiB): {[(t, round(b / GiB, 2) if b else b) for t, b in budgets]}")
        print(f"cache slots: first token {seen[0]}, lowest {low}, last {seen[-1]}; resizes "
              f"{rt.executor.cache.stats()['num_resizes']}; refilled {rt.executor.stats.refill_bytes / 1e9:.1f} GB "
              f"from the host bank; finish {final.finish_reason if final else '?'} {final.error if final else ''}; "
              f"tokens equal the unpressured run: {'yes' if same else 'NO'}")
        out["pressure"] = dict(budgets=budgets, slots=seen, same=same, finish=final.finish_reason if final else None)
        return same and low < seen[0] and final is not None and final.finish_reason == "length"
    finally:
        governor.close()
        if child is not None:
            (child.kill if on_cuda else child.cancel)()
        rt.close()


def section_profile(bench: Bench, out: dict) -> None:
    """Where a decode step's time goes (adaptive, middle cap): Python functions by own time, and the
    device's kernels against the host's launch work."""
    import cProfile
    import io
    import pstats

    print("\n## 5. Decode step profile (adaptive, middle cap)\n")
    cap = bench.args.caps[len(bench.args.caps) // 2]
    rt = bench.runtime("adaptive", bench.slots_for(int(cap * GiB)))
    try:
        model = rt.model
        cache = model.new_cache(1, 64)
        logits = model.forward(ForwardBatch.from_token_lists([bench.prompt(8, 7)], [0], [0]), cache)
        pos = 8
        gen = torch.Generator().manual_seed(3)

        def steps(n: int) -> None:
            nonlocal logits, pos
            for _ in range(n):
                tok = int(torch.multinomial(torch.softmax(logits[0].float(), -1), 1, generator=gen))
                logits = model.forward(ForwardBatch.from_token_lists([[tok]], [pos], [0]), cache)
                pos += 1

        steps(4)
        t0 = time.perf_counter()
        steps(8)
        print(f"8 steps, plain: {(time.perf_counter() - t0) / 8 * 1e3:.1f} ms per step")
        prof = cProfile.Profile()
        prof.enable()
        steps(8)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
        print("```\n" + "\n".join(buf.getvalue().splitlines()[:45]) + "\n```")
        if bench.args.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                steps(4)
            table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48)
            print("```\n" + table + "\n```")
            table = tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48)
            print("```\n" + table + "\n```")
    finally:
        rt.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "emulated"))
    ap.add_argument("--experts-dtype", default="int4", choices=("int4", "q8", "bf16", "mxfp4", GGML_Q4_K_M),
                    help=f"{GGML_Q4_K_M}: the ggml bank of a Q4_K_M file (GGUF block rows kept as stored)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--caps", default="4,8,16", help="VRAM caps, GiB")
    ap.add_argument("--reserve-mib", type=int, default=512, help="VRAM kept for activations and workspace")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", default="4096,16384")
    ap.add_argument("--emulated-bp", type=float, default=16.0, help="emulated device's link, GB/s")
    ap.add_argument("--sections", default="parity,decode,syncs,pressure,prefill,profile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",") if c]
    args.prefill = [int(n) for n in args.prefill.split(",") if n]
    sections = set(args.sections.split(","))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    bench = Bench(args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "emulated device"
    b_p = measure_b_p(bench)
    print(f"# moed real-shape check: {name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print(f"bench model: {args.layers} layers, {args.experts} experts x {args.inter}, hidden {args.hidden}, "
          f"top-{args.top_k}, {args.experts_dtype} bank {bench.bank.nbytes() / 1e9:.2f} GB "
          f"({bench.bank.bytes_per_expert() / 1e6:.2f} MB per expert), device weights {bench.weight_bytes / 1e9:.2f} GB; "
          f"built in {bench.build_s:.1f} s; pinned {bench.pin.pinned_bytes / 1e9:.1f} GB in {bench.pin_s:.1f} s "
          f"({bench.pin.reason or 'ok'}); B_P alone {b_p / 1e9:.1f} GB/s")
    out: dict = dict(device=name, torch=torch.__version__, b_p_alone=b_p, pool_bytes=bench.bank.nbytes())
    ok = True
    steps = [("parity", lambda: section_parity(bench, out)), ("decode", lambda: section_decode(bench, out)), ("syncs", lambda: section_syncs(bench, out)),
             ("pressure", lambda: section_pressure(bench, out)),
             ("prefill", lambda: section_prefill(bench, out, b_p)), ("profile", lambda: section_profile(bench, out))]
    for name, fn in steps:
        if name not in sections:
            continue
        started = time.perf_counter()
        try:
            result = fn()
            ok &= result is not False
        except Exception:
            traceback.print_exc()
            print(f"\nsection {name}: FAILED")
            ok = False
        print(f"\n({name}: {time.perf_counter() - started:.0f} s)")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"\nreal-shape check: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
