"""`moed generate`: load a model, stream the answer to stdout, report TTFT and decode speed."""

from __future__ import annotations

import argparse
import sys
import time

from moed.cli.engine_args import engine_config_from_args
from moed.cli.progress import ProgressBar
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams


def run_generate(args: argparse.Namespace) -> int:
    # validate request parameters before spending time on a load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    engine = engine_config_from_args(args)
    load_started = time.perf_counter()
    runtime = open_runtime(args.model, experts_dtype=args.experts_dtype, verify=args.verify,
                           progress=ProgressBar("loading"), engine=engine, trace_out=args.trace_out)
    load_s = time.perf_counter() - load_started
    prompt_ids = runtime.encode_prompt(args.prompt, chat=args.chat, system=args.system)
    generator = runtime.generator(args.context)

    def emit(_: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        (result,) = generator.generate([prompt_ids], [params], on_text=emit)
    finally:
        runtime.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    bank = runtime.loaded.bank
    print(f"[{result.finish_reason}] prompt {result.prompt_tokens} tok, generated {len(result.token_ids)} tok | "
          f"TTFT {result.ttft_s * 1000:.0f} ms | decode {result.decode_tok_s:.1f} tok/s | "
          f"experts {bank.dtype} | load {load_s:.1f} s", file=sys.stderr)
    s = runtime.executor.stats
    print(f"[engine] device {s.device}, policy {s.policy}, cache {s.cache_slots} slots "
          f"({s.cache_bytes / 1e6:.0f} MB) | hits {s.hits} misses {s.misses} (miss rate {s.miss_rate:.0%}) "
          f"fills {s.fills} (+{s.transient_fills} uncached) cpu {s.cpu_experts} | last q/m {s.last_q}/{s.last_m} | "
          f"B_P {s.b_p / 1e9:.1f} GB/s B_H {s.b_h / 1e9:.1f} GB/s", file=sys.stderr)
    return 0
