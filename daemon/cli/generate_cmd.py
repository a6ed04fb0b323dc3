"""`moed generate`: load a model, run one request on the engine loop in-process, stream the answer to stdout.

This is the same `EngineLoop` the daemon runs (via engine/offline_run.py: one request, one KV slot), so validation, finish
reasons and sampling are the daemon's; only the loading and the printing are the command's own.
"""

from __future__ import annotations

import argparse
import sys
import time

from moed.cli.engine_args import engine_config_from_args
from moed.cli.progress import ProgressBar
from moed.engine.memory_release import limit_malloc_arenas
from moed.engine.offline_run import run_offline
from moed.engine.request import StreamEvent
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError


def run_generate(args: argparse.Namespace) -> int:
    limit_malloc_arenas()  # before the engine's threads, as `moed serve` does: a long prompt's step temporaries
    # otherwise leave their freed chunks in one arena per thread (measured: +0.4 GiB peak at a 16k prompt)
    # validate request parameters before spending time on a load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    if args.context is not None and args.context < 2:
        raise InvalidRequestError(f"--context must be at least 2 tokens, got {args.context}")
    engine = engine_config_from_args(args)
    load_started = time.perf_counter()
    runtime = open_runtime(args.model, experts_dtype=args.experts_dtype, verify=args.verify,
                           progress=ProgressBar("loading"), engine=engine, trace_out=args.trace_out,
                           weights_dtype=args.dtype)
    load_s = time.perf_counter() - load_started
    try:
        prompt_ids = runtime.encode_prompt(args.prompt, chat=args.chat, system=args.system)
        (done,) = run_offline(runtime, [prompt_ids], [params], context_length=args.context, on_event=_print_delta)
    finally:
        runtime.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    usage = done.usage
    bank = runtime.loaded.bank
    print(f"[{done.finish_reason}] prompt {usage.prompt_tokens} tok, generated {usage.completion_tokens} tok | "
          f"TTFT {usage.ttft_s * 1000:.0f} ms | decode {usage.decode_tok_s:.1f} tok/s | "
          f"experts {bank.dtype} | load {load_s:.1f} s", file=sys.stderr)
    s = runtime.executor.stats
    print(f"[engine] device {s.device}, policy {s.policy}, cache {s.cache_slots} slots "
          f"({s.cache_bytes / 1e6:.0f} MB) | hits {s.hits} misses {s.misses} (miss rate {s.miss_rate:.0%}) "
          f"fills {s.fills} (+{s.transient_fills} uncached) cpu {s.cpu_experts} | last q/m {s.last_q}/{s.last_m} | "
          f"B_P {s.b_p / 1e9:.1f} GB/s B_H {s.b_h / 1e9:.1f} GB/s", file=sys.stderr)
    if done.finish_reason == "error":
        print(f"moed: error: {done.error}", file=sys.stderr)
        return 1
    if done.finish_reason == "cancelled":  # Ctrl-C
        return 130
    return 0


def _print_delta(_: int, event: StreamEvent) -> None:
    if event.text:
        sys.stdout.write(event.text)
        sys.stdout.flush()
