"""`moed serve`: run the daemon in the foreground (what the login service starts)."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

# Only light imports at module level: `moed` parses its arguments with this module imported, and
# the daemon installs its signal handlers before the heavy imports (torch, grpc, the engine) below.
from moed.service.signals import install_shutdown_handlers

log = logging.getLogger("moed.serve")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="load this model at start (directory or name)")
    parser.add_argument("--tcp", help="also listen on HOST:PORT (non-loopback needs a token: --token-file, "
                        "--token or $MOED_TOKEN)")
    parser.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI- and Anthropic-compatible HTTP "
                        "API on HOST:PORT (off by default; e.g. 127.0.0.1:8080; non-loopback needs a token, the "
                        "same one as gRPC's)")
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token", help="require this token as call metadata (default $MOED_TOKEN, else the "
                        "file $MOED_TOKEN_FILE); other local users can see it in the process list: prefer "
                        "--token-file")
    tokens.add_argument("--token-file", metavar="PATH", help="read the token from this file (one line; it must "
                        "be private to you: chmod 600)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "emulated", "cuda"))
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--context", type=int, default=0,
                        help="context length of --model (default: the longest the model supports whose KV pool "
                             "fits half the RAM the weights leave, at least 4096)")
    parser.add_argument("--kv-type", default="", choices=("", "bf16", "f32", "q8_0"),
                        help="K/V cache type of --model (q8_0: about half of bf16's bytes; default: the weights' own)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--vram-cap", default="auto", help="cap VRAM use: bytes (6G), a percentage (50%%) or auto")
    parser.add_argument("--emulated-bp", type=float, default=16.0, help="emulated device: B_P in GB/s")
    parser.add_argument("--keep-alive", default=os.environ.get("MOED_KEEP_ALIVE", "5m"),
                        help="how long a model loaded by a request stays after its last one: a duration (5m, 1h, "
                             "30s), 0 (unload at once) or -1 (forever); a request's keep_alive overrides it "
                             "(default 5m, or $MOED_KEEP_ALIVE)")
    parser.add_argument("--max-loaded-models", type=int, default=0,
                        help="at most this many models at once; the least recently used idle one is unloaded for "
                             "another (default 0: as many as the memory holds)")
    parser.add_argument("--models-memory", default="",
                        help="host RAM all loaded models may take together (e.g. 20G; default: what is free)")
    parser.add_argument("--load-timeout", type=float, default=300.0,
                        help="seconds a request waits for its model to load before a 503 with Retry-After")
    parser.add_argument("--no-load-on-demand", action="store_true",
                        help="serve only models loaded with `moed load` / --model (requests for others get 404)")
    parser.add_argument("--log-level", default="INFO")


def run_serve(args: argparse.Namespace, socket_path: str) -> int:
    # Signals first: a SIGTERM that arrives while the daemon starts (`systemctl --user stop moed`
    # right after a start) must end in the same orderly shutdown as one that arrives later, never
    # in the default "killed by SIGTERM". The event becomes the daemon's shutdown_requested.
    from moed.engine.memory_release import limit_malloc_arenas

    limit_malloc_arenas()  # before the daemon's threads: an unloaded model's memory goes back (memory_release)
    shutdown = threading.Event()
    restore = install_shutdown_handlers(shutdown.set)
    try:
        return _serve(args, socket_path, shutdown)
    finally:
        restore()


def _serve(args: argparse.Namespace, socket_path: str, shutdown: threading.Event) -> int:
    from moed import config
    from moed.api.daemon_context import DaemonContext
    from moed.api.server import DaemonServer, ServerConfig
    from moed.catalog.catalog import Catalog, CatalogRoots
    from moed.cli.client_cmds import parse_cap
    from moed.engine.model_manager import ModelManager
    from moed.service import paths
    from moed.service.instance_lock import InstanceLock
    from moed.service.log_setup import setup_logging
    from moed.service.memory_governor import GovernorConfig, MemoryGovernor
    from moed.service.memory_source import default_memory_source

    log_file = setup_logging(paths.log_dir(), args.log_level)
    socket = Path(socket_path.removeprefix("unix://").removeprefix("unix:"))
    lock = InstanceLock(socket.with_name(socket.name + ".lock")).acquire()
    governor = None
    server = None
    http = None
    ctx = None
    workers: list[threading.Thread] = []  # the initial load: joined before the process exits
    try:
        governor = MemoryGovernor(default_memory_source(gpu_memory_file=config.gpu_memory_file()), GovernorConfig())
        cap, fraction = parse_cap(args.vram_cap)
        if cap or fraction:
            governor.set_user_cap(cap or None, fraction=fraction)
        dirs = paths.model_dirs()
        manager = ModelManager(dirs, catalog=Catalog(CatalogRoots.default(dirs)))
        ctx = DaemonContext(manager=manager, governor=governor, shutdown_requested=shutdown,
                            pool=None if args.no_load_on_demand else _model_pool(
                                manager, args, on_loaded=lambda _: manager.apply_cache_budget(governor.budget())))
        token = config.daemon_token(args.token, args.token_file)
        server = DaemonServer(ctx, ServerConfig(socket_path=socket, tcp=args.tcp, token=token))
        if args.http:
            from moed.api.http.server import HttpServer

            http = HttpServer(ctx, args.http, token)  # checks the address (and the token rule) before binding
        if shutdown.is_set():  # asked to stop while starting: never open the socket
            log.info("shutdown requested during start-up")
        else:
            _run_until_shutdown(ctx, server, http, lock, args, log_file, workers)
    finally:
        if ctx is not None:
            log.info("shutting down (cancel in-flight: %s)", ctx.shutdown_cancel_inflight)
            ctx.stopping = True
            ctx.manager.close(cancel_inflight=ctx.shutdown_cancel_inflight)
            # A thread still running when the interpreter finalises is killed inside whatever native
            # code it is in (torch, numba): "terminate called without an active exception", SIGABRT.
            # The manager stops a load at its next read; the thread may not have reached the manager
            # yet (importing, planning), so wait for the thread itself, then unload what it loaded.
            for worker in workers:
                worker.join()
            ctx.manager.unload_all(cancel_inflight=ctx.shutdown_cancel_inflight)
        if ctx is not None and ctx.pool is not None:
            ctx.pool.stop()
        if http is not None:
            http.stop()
        if server is not None:
            server.stop()
        if governor is not None:
            governor.close()
        lock.release()
    return _stopped()


def _stopped() -> int:
    print("moed daemon stopped", flush=True)
    return 0


def _run_until_shutdown(ctx, server, http, lock, args: argparse.Namespace, log_file: Path,
                        workers: list[threading.Thread]) -> None:
    def on_budget(budget: int | None) -> None:
        # called on the governor thread: each model's loop applies its resize at its next safe point
        if ctx.manager.apply_cache_budget(budget):
            ctx.cache_resizes += 1
        log.info("VRAM budget now %s bytes", budget)

    ctx.governor.on_budget(on_budget)
    ctx.governor.start()
    if ctx.pool is not None:
        ctx.pool.start()
    # health says SERVING only when the daemon can serve: not before an initial --model load
    addresses = server.start(serving=not args.model)
    lock.update_address(addresses[0])
    if http is not None:
        http.start()
        ctx.http_url = http.url
        addresses.append(http.url)
    log.info("moed daemon pid %s, logs in %s", os.getpid(), log_file)
    print(f"moed daemon listening on {', '.join(addresses)} (logs: {log_file})", flush=True)
    if args.model:
        worker = threading.Thread(target=_initial_load, args=(ctx, server, args), daemon=True,
                                  name="moed-initial-load")
        workers.append(worker)
        worker.start()
    ctx.shutdown_requested.wait()


def _load_options(args: argparse.Namespace):
    """How --model and the models requests load on demand are loaded."""
    from moed.engine.model_manager import LoadOptions
    from moed.experts.policy_spec import parse_policy

    policy, options = parse_policy(args.policy)
    return LoadOptions(device=args.device, policy=policy, policy_options=options, cache_fraction=args.cache_fraction,
                       context_length=args.context or None, max_batch=args.max_batch, max_queue=args.max_queue,
                       emulated_b_p=args.emulated_bp * 1e9, kv_type=args.kv_type or None)


def _model_pool(manager, args: argparse.Namespace, on_loaded):
    """Loads on demand; ``on_loaded``: a model loaded on demand gets its share of the VRAM budget like the others."""
    from moed.cli.client_cmds import parse_cap
    from moed.engine.model_pool import ModelPool, PoolConfig, parse_keep_alive
    from moed.errors import InvalidRequestError

    budget = None
    if args.models_memory:
        budget, fraction = parse_cap(args.models_memory)
        if fraction is not None or not budget:
            raise InvalidRequestError(f"--models-memory {args.models_memory!r}: give bytes, e.g. 20G")
    if args.max_loaded_models < 0 or args.load_timeout <= 0:
        raise InvalidRequestError("--max-loaded-models must be >= 0 and --load-timeout > 0")
    return ModelPool(manager, PoolConfig(keep_alive_s=parse_keep_alive(args.keep_alive),
                                         max_loaded=args.max_loaded_models, load_wait_s=args.load_timeout,
                                         memory_budget=budget, options=_load_options(args)), on_loaded=on_loaded)


def _initial_load(ctx, server, args: argparse.Namespace) -> None:
    server.set_serving(False)
    try:
        ctx.manager.load(args.model, _load_options(args))
        ctx.manager.apply_cache_budget(ctx.governor.budget() if ctx.governor else None)
    except Exception as exc:  # the daemon stays up; the error is in status and the log
        ctx.last_error = f"loading {args.model}: {exc}"
        log.error("%s", ctx.last_error)
    finally:
        server.set_serving(True)
