"""`moed serve`: run the daemon in the foreground (what the login service starts)."""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path

from moed import config
from moed.api.daemon_context import DaemonContext
from moed.api.server import DaemonServer, ServerConfig
from moed.cli.client_cmds import parse_cap
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.experts.policy_spec import parse_policy
from moed.service import paths
from moed.service.instance_lock import InstanceLock
from moed.service.log_setup import setup_logging
from moed.service.memory_governor import GovernorConfig, MemoryGovernor
from moed.service.memory_source import default_memory_source
from moed.service.signals import install_shutdown_handlers

log = logging.getLogger("moed.serve")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="load this model at start (directory or name)")
    parser.add_argument("--tcp", help="also listen on HOST:PORT (non-loopback needs --token)")
    parser.add_argument("--token", help="require this token as call metadata (default $MOED_TOKEN)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "emulated", "cuda"))
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--vram-cap", default="auto", help="cap VRAM use: bytes (6G), a percentage (50%%) or auto")
    parser.add_argument("--emulated-bp", type=float, default=16.0, help="emulated device: B_P in GB/s")
    parser.add_argument("--log-level", default="INFO")


def run_serve(args: argparse.Namespace, socket_path: str) -> int:
    log_file = setup_logging(paths.log_dir(), args.log_level)
    socket = Path(socket_path.removeprefix("unix://").removeprefix("unix:"))
    lock = InstanceLock(socket.with_name(socket.name + ".lock")).acquire()
    governor = MemoryGovernor(default_memory_source(gpu_memory_file=config.gpu_memory_file()), GovernorConfig())
    cap, fraction = parse_cap(args.vram_cap)
    if cap or fraction:
        governor.set_user_cap(cap or None, fraction=fraction)
    ctx = DaemonContext(manager=ModelManager(paths.model_dirs()), governor=governor)
    server = DaemonServer(ctx, ServerConfig(socket_path=socket, tcp=args.tcp, token=args.token or config.daemon_token()))
    addresses = server.start()
    lock.update_address(addresses[0])
    log.info("moed daemon pid %s, logs in %s", __import__("os").getpid(), log_file)
    print(f"moed daemon listening on {', '.join(addresses)} (logs: {log_file})", flush=True)

    def on_budget(budget: int | None) -> None:
        # called on the governor thread: each model's loop applies its resize at its next safe point
        if ctx.manager.apply_cache_budget(budget):
            ctx.cache_resizes += 1
        log.info("VRAM budget now %s bytes", budget)

    governor.on_budget(on_budget)
    governor.start()
    restore = install_shutdown_handlers(ctx.shutdown_requested.set)
    if args.model:
        threading.Thread(target=_initial_load, args=(ctx, server, args), daemon=True, name="moed-initial-load").start()
    try:
        ctx.shutdown_requested.wait()
    finally:
        log.info("shutting down (cancel in-flight: %s)", ctx.shutdown_cancel_inflight)
        ctx.stopping = True
        ctx.manager.unload_all(cancel_inflight=ctx.shutdown_cancel_inflight)
        server.stop()
        governor.close()
        restore()
        lock.release()
    print("moed daemon stopped", flush=True)
    return 0


def _initial_load(ctx: DaemonContext, server: DaemonServer, args: argparse.Namespace) -> None:
    server.set_serving(False)
    try:
        policy, options = parse_policy(args.policy)
        ctx.manager.load(args.model, LoadOptions(device=args.device, policy=policy, policy_options=options,
                                                 cache_fraction=args.cache_fraction,
                                                 context_length=args.context or None, max_batch=args.max_batch,
                                                 max_queue=args.max_queue, emulated_b_p=args.emulated_bp * 1e9))
        ctx.manager.apply_cache_budget(ctx.governor.budget() if ctx.governor else None)
    except Exception as exc:  # the daemon stays up; the error is in status and the log
        ctx.last_error = f"loading {args.model}: {exc}"
        log.error("%s", ctx.last_error)
    finally:
        server.set_serving(True)
