"""The CLI's daemon-client commands: run, chat, ps, load, unload, cap, status, calibrate, stop."""

from __future__ import annotations

import argparse
import sys
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path

from moed.api.client import DaemonCallError, MoedClient
from moed.cache.expert_dtypes import LOAD_DTYPES
from moed.cli.progress import ProgressBar
from moed.errors import InvalidRequestError


def add_client_commands(sub, add_address) -> None:
    run = sub.add_parser("run", help="ask the running daemon one prompt (streamed): `moed run [MODEL] PROMPT`")
    add_address(run)
    run.add_argument("words", nargs="+", metavar="[MODEL] PROMPT",
                     help="the prompt, after a model name (qwen3:30b-a3b, org/repo:Q4_K_M, a path) when two are given; "
                          "a model that is not loaded is loaded first")
    run.add_argument("--model", default="", help="model name (default: the only loaded one)")
    run.add_argument("--no-pull", action="store_true", help="do not pull a Hugging Face model (ORG/REPO[:QUANT]) "
                     "that is not on this machine (by default `moed run` pulls it first, as `ollama run` does)")
    run.add_argument("--raw", action="store_true", help="plain prompt, no chat template")
    add_sampling(run)

    chat = sub.add_parser("chat", help="interactive chat with the running daemon")
    add_address(chat)
    chat.add_argument("--model", default="")
    chat.add_argument("--system", help="system message")
    add_sampling(chat)

    ps = sub.add_parser("ps", help="loaded models and loads in flight: state, memory, time to unload (like `ollama ps`)")
    add_address(ps)

    models = sub.add_parser("models", help="every model the daemon finds by name: moed's folders, Ollama's store, the "
                            "Hugging Face cache, LM Studio's folder (like `ollama list`)")
    add_address(models)

    load = sub.add_parser("load", help="load a model into the daemon")
    add_address(load)
    load.add_argument("model", help="model directory, .gguf file, or name found in the model directories")
    load.add_argument("--name", default="")
    load.add_argument("--device", default="auto", choices=("auto", "cpu", "emulated", "cuda"))
    load.add_argument("--policy", default="adaptive")
    load.add_argument("--cache-fraction", type=float)
    load.add_argument("--context", type=int, default=0,
                      help="context length in tokens (default: the longest the model supports whose KV pool "
                           "fits half the RAM the weights leave, at least 4096)")
    load.add_argument("--experts-dtype", default="", choices=("", *LOAD_DTYPES))
    load.add_argument("--kv-tokens", type=int, default=0,
                      help="KV pool size in tokens, shared by all sequences (default: two whole contexts)")
    load.add_argument("--kv-type", default="", choices=("", "bf16", "f32", "q8_0"),
                      help="K/V cache type (llama.cpp's -ctk/-ctv): bf16, f32, or q8_0 (8.5 bits per value, about "
                           "half of bf16: twice the context in the same RAM; default: the weights' own, bf16 or f32)")
    load.add_argument("--no-prefix-cache", action="store_true",
                      help="prefill every prompt from its first token (default: reuse the K/V of cached prefixes)")
    load.add_argument("--weights-dtype", default="auto", choices=("auto", "fp32"),
                      help="non-expert weights: the checkpoint's own dtype (auto) or widened to fp32")
    load.add_argument("--max-batch", type=int, default=0)
    load.add_argument("--verify", action="store_true")

    unload = sub.add_parser("unload", help="unload a model")
    add_address(unload)
    unload.add_argument("model")

    cap = sub.add_parser("cap", help="cap the daemon's VRAM use: bytes (e.g. 6G), a percentage (50%%) or auto")
    add_address(cap)
    cap.add_argument("value")

    status = sub.add_parser("status", help="daemon status")
    add_address(status)
    status.add_argument("--watch", action="store_true", help="keep printing updates")
    status.add_argument("--interval", type=float, default=1.0)

    calibrate = sub.add_parser("calibrate", help="measure B_P and B_H for a loaded model (stored per machine)")
    add_address(calibrate)
    calibrate.add_argument("--model", default="")
    calibrate.add_argument("--seconds", type=float, default=1.0)

    stop = sub.add_parser("stop", help="stop the daemon (running requests finish first unless --cancel)")
    add_address(stop)
    stop.add_argument("--cancel", action="store_true")


def add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[])


def sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
              stop=args.stop)
    for name in ("top_p", "repetition_penalty", "seed"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    return kw


def gb(n: int | float) -> str:
    return f"{n / 1e9:.2f} GB"


MAX_CAP_BYTES = 2**60  # ~1.15 EB: far above any GPU, well inside the protocol's uint64
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_CAP_HELP = "write bytes (6G, 6000M), a percentage (50%) or auto"


def parse_cap(value: str) -> tuple[int, float | None]:
    """'6G' -> (6e9, None); '50%' -> (0, 0.5); 'auto' -> (0, None). InvalidRequestError (one line) for
    anything else: empty, negative, NaN/inf, a percentage outside (0, 100], more than MAX_CAP_BYTES."""
    text = value.strip().lower()
    if text in ("auto", "off", "none", "0"):
        return 0, None
    if text.endswith("%"):
        percent = _decimal(text[:-1])
        if percent is None:
            raise InvalidRequestError(f"cap {value!r}: write a percentage like 50% (or auto)")
        fraction = float(percent) / 100 if -1000 < percent < 1000 else -1.0
        if not 0 < fraction <= 1:
            raise InvalidRequestError(f"cap {value!r}: a percentage must be above 0% and at most 100% (or auto)")
        return 0, fraction
    scale = _UNITS.get(text[-1:], 1)
    number = _decimal(text[:-1] if text[-1:] in _UNITS else text)
    if number is None:
        raise InvalidRequestError(f"cap {value!r}: {_CAP_HELP}")
    if number < 0:
        raise InvalidRequestError(f"cap {value!r} must be positive (or auto)")
    if number.adjusted() > 30 or number * scale > MAX_CAP_BYTES:  # adjusted(): no huge products
        raise InvalidRequestError(f"cap {value!r} is too large: at most {MAX_CAP_BYTES} bytes "
                                  f"({MAX_CAP_BYTES / 1e18:.2f} EB); {_CAP_HELP}")
    cap = int(number * scale) if number.adjusted() > -30 else 0
    if cap <= 0:
        raise InvalidRequestError(f"cap {value!r} must be at least 1 byte (or auto)")
    return cap, None


def _decimal(text: str) -> Decimal | None:
    """A finite decimal number, or None (empty, NaN, infinity, not a number)."""
    try:
        number = Decimal(text.strip())
    except (InvalidOperation, ValueError):
        return None
    return number if number.is_finite() and text.strip() else None


def pull_missing(model: str, exc: DaemonCallError) -> bool:
    """The daemon found no model ``model`` and it names a Hugging Face repository: pull it into the Hugging Face
    cache (where the daemon finds it) and say so; False when that does not apply."""
    import grpc

    from moed.catalog.hub_pull import parse_name, plan_pull, pull

    if not model or exc.code != grpc.StatusCode.INVALID_ARGUMENT or "not found" not in str(exc) or Path(model).exists():
        return False
    try:
        parse_name(model)
    except InvalidRequestError:
        return False
    if "/" not in model:
        return False
    print(f"{model} is not on this machine: pulling it from the Hugging Face Hub (--no-pull to skip)", file=sys.stderr)
    plan = plan_pull(model)
    pull(plan, bar=True)
    return True


def stream_answer(client: MoedClient, **kw) -> None:
    final = None
    for part in client.generate(**kw):
        sys.stdout.write(part.text)
        sys.stdout.flush()
        if part.done:
            final = part
    sys.stdout.write("\n")
    if final is not None:
        u = final.usage
        print(f"[{final.finish_reason}] prompt {u.prompt_tokens} tok, generated {u.completion_tokens} tok | "
              f"TTFT {u.ttft_seconds * 1000:.0f} ms | decode {u.decode_tokens_per_second:.1f} tok/s", file=sys.stderr)


def run_client_command(args: argparse.Namespace, client: MoedClient) -> int:
    cmd = args.command
    if cmd == "run":
        if len(args.words) > 1 and not args.model:
            model, *rest = args.words
            args.model = str(Path(model).resolve()) if Path(model).exists() else model
            args.prompt = " ".join(rest)
        else:
            args.prompt = " ".join(args.words)
        ask = (dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}]))
        try:
            stream_answer(client, model=args.model, **ask, **sampling_kwargs(args))
        except DaemonCallError as exc:
            if args.no_pull or not pull_missing(args.model, exc):
                raise
            stream_answer(client, model=args.model, **ask, **sampling_kwargs(args))
    elif cmd == "chat":
        return chat_loop(client, args)
    elif cmd == "ps":
        print_ps(client)
    elif cmd == "models":
        print_models(client)
    elif cmd == "load":
        options = dict(name=args.name, device=args.device, policy=args.policy, context_length=args.context,
                       experts_dtype=args.experts_dtype, verify=args.verify, max_batch=args.max_batch,
                       weights_dtype=args.weights_dtype, no_prefix_cache=args.no_prefix_cache,
                       kv_tokens=args.kv_tokens, kv_type=args.kv_type or "")
        if args.cache_fraction is not None:
            options["cache_fraction"] = args.cache_fraction
        bar = ProgressBar(f"loading {args.model}", min_seconds=0.0)
        # a path that exists here is sent absolute (the daemon's working directory is not ours)
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        for progress in client.load(model, **options):
            if progress.stage == "reading" and progress.total_bytes:
                bar(progress.done_bytes, progress.total_bytes)
            if progress.HasField("model"):
                m = progress.model
                print(f"loaded {m.name} ({m.family}, {m.experts_dtype} experts) on {m.device}, policy {m.policy}: "
                      f"{gb(m.host_bytes)} host, {gb(m.vram_bytes)} device cache")
    elif cmd == "unload":
        client.unload(args.model)
        print(f"unloaded {args.model}")
    elif cmd == "cap":
        cap, fraction = parse_cap(args.value)
        status = client.set_vram_cap(cap, fraction)
        print(f"VRAM cap: {gb(status.memory.cap_bytes) if status.memory.cap_bytes else 'auto'}; "
              f"budget now {gb(status.memory.budget_bytes)}")
    elif cmd == "status":
        if args.watch:
            for status in client.watch_status(args.interval):
                print_status(status)
                print("-" * 60)
        else:
            print_status(client.status())
    elif cmd == "calibrate":
        reply = client.calibrate(args.model, args.seconds)
        print(f"B_P {reply.b_p / 1e9:.2f} GB/s (with CPU busy {reply.b_p_concurrent / 1e9:.2f}), "
              f"B_H {reply.b_h / 1e9:.2f} GB/s (with copies {reply.b_h_concurrent / 1e9:.2f}); "
              f"q*/m = {reply.q_ratio:.2f} on {reply.device}")
    elif cmd == "stop":
        client.shutdown(cancel_inflight=args.cancel)
        print("daemon stopping")
    return 0


def until(m) -> str:
    """When a loaded model unloads if it stays idle (`ollama ps`'s UNTIL)."""
    if not m.HasField("expires_in_seconds"):
        return "forever"
    seconds = int(m.expires_in_seconds)
    return "now" if seconds <= 0 else f"in {seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"in {seconds} s"


def print_ps(client: MoedClient) -> None:
    models = [m for m in client.list_models() if m.loaded or m.state == "loading"]
    if not models:
        print("no model is loaded (`moed models` lists those on disk; a request naming one loads it)")
        return
    print(f"{'NAME':32} {'STATE':10} {'DEVICE':9} {'EXPERTS':7} {'CONTEXT':>8} {'HOST':>10} {'DEVICE MEM':>11} "
          f"{'UNTIL':>16}")
    for m in models:
        if m.state == "loading":
            print(f"{m.name[:32]:32} {'loading':10} {'-':9} {'-':7} {'-':>8} {'-':>10} {'-':>11} "
                  f"{f'{m.load_fraction:.0%}, {m.load_seconds:.0f} s':>16}")
            continue
        print(f"{m.name[:32]:32} {m.state or 'loaded':10} {m.device or '-':9} {m.experts_dtype or '-':7} "
              f"{m.context_length:>8} {gb(m.host_bytes):>10} {gb(m.vram_bytes):>11} {until(m):>16}")


def print_models(client: MoedClient) -> None:
    models = client.list_models()
    if not models:
        print("no models found: `moed pull ORG/REPO[:QUANT]` fetches one from the Hugging Face Hub, `moed convert` "
              "makes one, and models in Ollama's store, the Hugging Face cache or LM Studio's folder appear here")
        return
    print(f"{'NAME':48} {'SOURCE':11} {'FORMAT':6} {'SIZE':>10} {'STATE':10} PATH")
    for m in models:
        state = m.state or ("loaded" if m.loaded else "on disk")
        print(f"{m.name[:48]:48} {m.source or '-':11} {m.format or '-':6} "
              f"{gb(m.disk_bytes) if m.disk_bytes else '-':>10} {state:10} {m.path}")


def print_status(s) -> None:
    print(f"state {s.state} | version {s.version} | active {s.active_requests} queued {s.queued_requests} | "
          f"{s.tokens_per_second:.1f} tok/s | served {s.requests_served}")
    print(f"  HTTP API {s.http_url} (OpenAI: {s.http_url}/v1, Anthropic and Ollama: {s.http_url})" if s.http_url
          else "  HTTP API off (start the daemon with --http 127.0.0.1:8080 for agents and OpenAI/Anthropic clients)")
    for m in s.models:
        print(f"  model {m.name}: {m.device}, policy {m.policy}, {m.experts_dtype} experts, context {m.context_length}")
    e, mem = s.engine, s.memory
    if e.device:
        lookups = e.hits + e.misses
        rate = e.misses / lookups if lookups else 0.0
        print(f"  experts: hits {e.hits} misses {e.misses} ({rate:.0%}) fills {e.fills} cpu {e.cpu_experts} | "
              f"q/m {e.last_q}/{e.last_m} | B_P {e.b_p / 1e9:.1f} GB/s B_H {e.b_h / 1e9:.1f} GB/s | "
              f"cache {e.cache_slots} slots {gb(e.cache_bytes)} | pinned {gb(e.pinned_bytes)} pageable {gb(e.pageable_bytes)}")
        if e.device in ("cuda", "emulated"):
            where = (f"on the device ({gb(e.model_device_bytes)} weights + KV cache)" if e.model_device_bytes
                     else f"on the host ({e.model_note or 'kept there'})")
            print(f"  model {where} | prefill layers streamed {e.streamed_layers}")
    if e.kv_blocks:
        share = e.cached_prompt_tokens / e.prompt_tokens if e.prompt_tokens else 0.0
        cache = (f"prefix cache {e.kv_cached_blocks} blocks, {e.cached_prompt_tokens} of {e.prompt_tokens} prompt "
                 f"tokens reused ({share:.0%}), {e.kv_evicted_blocks} blocks evicted" if e.prefix_cache
                 else "prefix cache off")
        print(f"  KV pool {e.kv_used_blocks}/{e.kv_blocks} blocks of {e.kv_block_size} tokens ({gb(e.kv_bytes)}), "
              f"{e.kv_preempted} preemptions | {cache}"
              + (f" | {e.state_checkpoints} state checkpoints ({gb(e.state_checkpoint_bytes)})"
                 if e.state_checkpoints else ""))
    vram = (f"VRAM total {gb(mem.vram_total)}, other apps {gb(mem.vram_other_apps)}, ours {gb(mem.vram_ours)}, "
            f"free {gb(mem.vram_free)}" if mem.has_gpu else "no GPU memory readings")
    cap = gb(mem.cap_bytes) if mem.cap_bytes else "auto"
    budget = gb(mem.budget_bytes) if (mem.has_gpu or mem.cap_bytes) else "unlimited"
    print(f"  memory ({mem.source}): {vram}; budget {budget}, cap {cap}; host RAM "
          f"{gb(mem.host_available)} free of {gb(mem.host_total)} | cache resizes {s.cache_resizes}")
    if s.last_error:
        print(f"  last error: {s.last_error}")


def chat_loop(client: MoedClient, args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the daemon; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        answer = []
        started = time.perf_counter()
        for part in client.generate(messages=messages, model=args.model, **sampling_kwargs(args)):
            sys.stdout.write(part.text)
            sys.stdout.flush()
            answer.append(part.text)
        sys.stdout.write(f"\n({time.perf_counter() - started:.1f} s)\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
