"""`moed bench kernels`: this machine's host read bandwidth and the CPU expert kernels' GB/s."""

from __future__ import annotations

import argparse
import json

from moed.errors import InvalidRequestError


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            hidden, inter = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise InvalidRequestError(f"--shapes: {part!r} is not DxI (for example 2048x768)") from None
        if hidden <= 0 or inter <= 0:
            raise InvalidRequestError(f"--shapes: {part!r} needs positive sizes")
        shapes.append((hidden, inter))
    return shapes


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "bw":
        return run_bench_bw(args)
    if args.bench_command == "policy":
        return run_bench_policy(args)
    from moed.cache.host_bank import EXPERT_DTYPES, INT4_GROUP_SIZE, PACKED_DTYPES
    from moed.experts.kernel_bench import bench_kernels, format_table, ggml_bench_dtypes

    known = (*EXPERT_DTYPES, *ggml_bench_dtypes())
    dtypes = [d.strip() for d in (args.dtypes or ",".join(known)).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in known]
    if bad or not dtypes:
        raise InvalidRequestError(f"--dtypes: {bad or dtypes} not among {', '.join(known)}")
    shapes = parse_shapes(args.shapes)
    packed = [d for d in dtypes if d in PACKED_DTYPES]
    for hidden, inter in shapes:
        if packed and (hidden % INT4_GROUP_SIZE or inter % INT4_GROUP_SIZE):
            raise InvalidRequestError(f"--shapes: {', '.join(packed)} need D and I to be multiples of "
                                      f"{INT4_GROUP_SIZE}, got {hidden}x{inter}")
    rows = bench_kernels(shapes, dtypes)
    if getattr(args, "dense", ""):
        from moed.experts.kernel_bench import bench_dense

        dense = parse_shapes(args.dense)  # N x K
        if any(k % INT4_GROUP_SIZE or n % 2 for n, k in dense):
            raise InvalidRequestError(f"--dense: N must be even and K a multiple of {INT4_GROUP_SIZE}, got {args.dense}")
        try:
            rows += bench_dense(dense)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def run_bench_bw(args: argparse.Namespace) -> int:
    """Calibrate B_P and B_H with the model's real expert shape and dtype; store the profile."""
    from moed.experts.executor_factory import select_device
    from moed.experts.calibration import calibrate, save_profile
    from moed.weights.model_loader import load_model

    if args.seconds <= 0:
        raise InvalidRequestError(f"--seconds must be positive, got {args.seconds}")
    device = select_device(args.device, b_p=args.emulated_bp * 1e9, b_dev=900e9)
    if device.kind == "cpu":
        raise InvalidRequestError("no CUDA device here: calibrate against `--device emulated` or on a GPU machine")
    bank = load_model(args.model, experts_dtype=args.experts_dtype).bank
    # serving copies from the pinned bank, so B_P is measured from pinned memory too
    report = device.pin_host(bank.storage())
    try:
        profile = calibrate(device, bank, seconds=args.seconds)
    finally:
        device.unpin_host(report)
    if report.pageable_bytes:
        print(f"warning: {report.summary()}; B_P below is partly from pageable memory")
    gb = 1e9
    print(f"machine: {profile.machine}\ndevice:  {profile.device}\nexperts: {profile.expert_shape}, "
          f"{profile.bytes_per_expert / 1e6:.2f} MB each")
    print(f"B_P alone {profile.b_p / gb:6.2f} GB/s   both at once {profile.b_p_concurrent / gb:6.2f} GB/s")
    print(f"B_H alone {profile.b_h / gb:6.2f} GB/s   both at once {profile.b_h_concurrent / gb:6.2f} GB/s")
    print(f"q*/m = B_P / B_H = {profile.q_ratio:.2f}")
    if not args.no_save:
        print(f"profile saved to {save_profile(profile, bank)}")
    return 0


def run_bench_policy(args: argparse.Namespace) -> int:
    from moed.experts.policies import POLICY_NAMES
    from moed.experts.policy_replay import run_policy_bench, synthetic_trace

    try:
        fractions = [float(f) for f in args.cache_fraction.split(",") if f.strip()]
    except ValueError:
        raise InvalidRequestError(f"--cache-fraction {args.cache_fraction!r}: comma-separated numbers in (0, 1]") from None
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise InvalidRequestError(f"--cache-fraction {args.cache_fraction!r}: each must be in (0, 1]")
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else list(POLICY_NAMES)
    if args.num_experts is not None and args.num_experts <= 0:
        raise InvalidRequestError(f"--num-experts must be positive, got {args.num_experts}")
    if args.trace:
        print(run_policy_bench(args.trace, fractions, policies, json=args.json, num_experts=args.num_experts))
        return 0
    # no trace given: synthetic traces with high and low temporal locality (48 layers x 128 experts, top-8)
    for kind in ("high", "low"):
        trace = synthetic_trace(kind, num_layers=48, num_experts=128, top_k=8, num_tokens=300, seed=0, num_prefill=128)
        if not args.json:
            print(f"\nsynthetic trace, {kind} temporal locality")
        print(run_policy_bench(trace, fractions, policies, json=args.json))
    return 0
