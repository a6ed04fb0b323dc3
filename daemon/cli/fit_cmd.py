"""`moed fit MODEL`: where a model would run on machines of given RAM and VRAM (engine/fit_plan.py)."""

from __future__ import annotations

import argparse

from moed.errors import InvalidRequestError


def _sizes(text: str) -> list[int]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in GB separated by commas, e.g. 24,64,128") from None
    if not values or any(not 0 <= v <= 1e6 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be between 0 and 1000000 GB")
    return [int(v * 10**9) for v in values]


def add_fit_command(sub) -> None:
    fit = sub.add_parser(
        "fit", help="what a model needs and where it would run, from its config alone if need be",
        description="Plan a model for machines of the given RAM and VRAM, as a load would: the expert bank in "
                    "host RAM, the other weights and the KV cache on the GPU when they fit there, the expert "
                    "cache in the rest. MODEL is a model directory, a GGUF file, or a config.json (or a "
                    "directory holding only one): no weights are needed.")
    fit.add_argument("model", help="model directory, GGUF file or config.json")
    fit.add_argument("--ram", type=_sizes, default=None, metavar="GB,...", help="host RAM sizes (default 24,64,128)")
    fit.add_argument("--vram", type=_sizes, default=None, metavar="GB,...",
                     help="GPU memory sizes, 0 for none (default 0,8,16,32)")
    fit.add_argument("--experts-dtype", default=None, help="plan this expert bank dtype instead of the default")


def run_fit(args) -> int:
    from moed.cache.expert_dtypes import LOAD_DTYPES
    from moed.engine.fit_plan import DEFAULT_RAM_GB, DEFAULT_VRAM_GB, fit_machine, format_report, model_needs

    if args.experts_dtype is not None and args.experts_dtype not in LOAD_DTYPES:
        raise InvalidRequestError(f"--experts-dtype {args.experts_dtype!r}: choose one of {', '.join(LOAD_DTYPES)}")
    rams = args.ram or [g * 10**9 for g in DEFAULT_RAM_GB]
    vrams = args.vram or [g * 10**9 for g in DEFAULT_VRAM_GB]
    # a machine with a GPU may get another bank than a CPU-only one (NVFP4 / GGUF blocks are kept by default on a CPU-only one)
    cpu = model_needs(args.model, args.experts_dtype, cpu_only=True)
    gpu = model_needs(args.model, args.experts_dtype, cpu_only=False) if any(vrams) else cpu
    print(format_report(cpu if not all(vrams) else gpu,
                        [fit_machine(gpu if v else cpu, r, v) for r in rams for v in vrams]))
    if gpu.load.bank_dtype != cpu.load.bank_dtype:
        print(f"(the expert bank is {cpu.load.bank_dtype} on machines without a GPU, {gpu.load.bank_dtype} with one)")
    return 0
