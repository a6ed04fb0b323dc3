"""Control service: load/unload, listing, VRAM cap, pause, status, calibration, shutdown."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from moed.api.convert import engine_figures, memory_figures, model_info
from moed.api.daemon_context import DaemonContext
from moed.api.errors import abort_with, one_line
from moed.experts.policy_spec import parse_policy
from moed.engine.load_plan import LOAD_DTYPES
from moed.engine.model_manager import LoadOptions, dir_bytes
from moed.errors import InvalidRequestError, MoedError, quoted
from moed.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger("moed.api")


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, ctx: DaemonContext, set_serving_health: Callable[[bool], None]) -> None:
        self.ctx = ctx
        self.set_serving_health = set_serving_health
        self._load_lock = threading.Lock()

    # -- models -------------------------------------------------------------------------------
    def LoadModel(self, request, context):
        try:
            options = self._load_options(request)
        except MoedError as exc:
            abort_with(context, exc)
        events: queue.Queue = queue.Queue()
        outcome: dict = {}

        def progress(stage: str, done: int, total: int) -> None:
            events.put(control_pb2.LoadModelProgress(stage=stage, done_bytes=done, total_bytes=total))

        def work() -> None:
            try:
                outcome["entry"] = self.ctx.manager.load(request.model, options, name=request.name, progress=progress)
            except BaseException as exc:  # reported to the caller below
                outcome["error"] = exc
            finally:
                self._health_after_load()
                events.put(None)

        self.set_serving_health(False)  # NOT_SERVING while a model loads
        worker = threading.Thread(target=work, name="moed-load", daemon=True)
        worker.start()
        yield control_pb2.LoadModelProgress(stage="queued")
        while True:
            event = events.get()
            if event is None:
                break
            yield event
        if "error" in outcome:
            self.ctx.last_error = one_line(str(outcome["error"]))
            abort_with(context, outcome["error"])
        entry = outcome["entry"]
        if self.ctx.pool is not None:
            self.ctx.pool.forget_explicit(entry.name)  # loaded by hand: it stays until unloaded
        self.ctx.manager.apply_cache_budget(self._cache_budget())
        log.info("loaded %s from %s (%s, %s)", entry.name, entry.path, entry.stats.device, entry.stats.policy)
        yield control_pb2.LoadModelProgress(stage="ready", model=model_info(entry, disk_bytes=dir_bytes(entry.path)))

    def _health_after_load(self) -> None:
        if not self.ctx.manager.is_loading:
            self.set_serving_health(True)

    @staticmethod
    def _load_options(request) -> LoadOptions:
        policy, policy_options = parse_policy(request.policy or "adaptive")
        from moed.experts.policies import POLICY_NAMES

        if policy not in POLICY_NAMES:
            raise InvalidRequestError(f"policy {quoted(policy)} is not one of {', '.join(POLICY_NAMES)}")
        if request.experts_dtype and request.experts_dtype not in LOAD_DTYPES:
            raise InvalidRequestError(f"experts_dtype {quoted(request.experts_dtype)}: choose one of "
                                      f"{', '.join(LOAD_DTYPES)}")
        fraction = request.cache_fraction if request.HasField("cache_fraction") else 0.25
        if not 0.0 <= fraction <= 1.0:
            raise InvalidRequestError(f"cache_fraction must be between 0 and 1, got {fraction}")
        if request.max_batch > 256:
            raise InvalidRequestError(f"max_batch {request.max_batch} is too large (at most 256)")
        if request.max_queue > 100_000:
            raise InvalidRequestError(f"max_queue {request.max_queue} is too large (at most 100000)")
        return LoadOptions(device=request.device or "auto", policy=policy, policy_options=policy_options,
                           cache_fraction=fraction, context_length=request.context_length or None,
                           experts_dtype=request.experts_dtype or None, verify=request.verify,
                           max_batch=request.max_batch or 8, max_queue=request.max_queue or 64,
                           emulated_b_p=request.emulated_b_p or 16e9, weights_dtype=request.weights_dtype or "auto",
                           prefix_cache=not request.no_prefix_cache, kv_tokens=request.kv_tokens or None,
                           kv_type=request.kv_type or None)

    def UnloadModel(self, request, context):
        if not request.model:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name the model to unload")
        if not self.ctx.manager.unload(request.model):
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {quoted(request.model)} is not loaded")
        return control_pb2.UnloadModelResponse(unloaded=True)

    def ListModels(self, request, context):
        """Loaded models, those being loaded on demand, then every model on disk the catalog finds (moed's folders,
        Ollama's store, the Hugging Face cache, LM Studio's folder)."""
        pool = self.ctx.pool
        loaded = self.ctx.manager.loaded()
        infos = [model_info(e, disk_bytes=dir_bytes(e.path), pool=pool) for e in loaded]
        busy = {e.name for e in loaded} | {str(e.path.resolve()) for e in loaded}
        in_flight = {name: (seconds, 0.0) for name, seconds in (pool.loading() if pool is not None else {}).items()}
        in_flight.update(self.ctx.manager.loading())  # explicit loads too, with the fraction read
        for name, (seconds, fraction) in sorted(in_flight.items()):
            infos.append(control_pb2.ModelInfo(name=name, state="loading", load_seconds=seconds,
                                               load_fraction=fraction))
            busy.add(name)
        for found in self.ctx.manager.catalog.list():
            if found.name not in busy and str(found.path.resolve()) not in busy:
                infos.append(model_info(found=found))
        return control_pb2.ListModelsResponse(models=infos)

    # -- memory and serving ---------------------------------------------------------------------
    def _cache_budget(self) -> int | None:
        governor = self.ctx.governor
        budget = governor.budget() if governor is not None else None
        return budget

    def SetVramCap(self, request, context):
        governor = self.ctx.governor
        if governor is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no memory governor is running")
        cap = request.cap_bytes or None
        if request.HasField("cap_fraction"):
            if not 0.0 < request.cap_fraction <= 1.0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cap_fraction must be in (0, 1]")
            total = governor.figures().get("vram_total") or 0
            if not total:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no GPU memory total known: give the cap in bytes")
            cap = int(request.cap_fraction * total)
            if cap < 1:  # 0 would mean "no cap": the opposite of what a tiny fraction asks for
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"cap_fraction {request.cap_fraction!r} of {total} bytes is below one byte")
        governor.set_user_cap(cap)
        self.ctx.manager.apply_cache_budget(self._cache_budget())
        return self._status()

    def SetServing(self, request, context):
        self.ctx.paused = bool(request.paused)
        return self._status()

    # -- status -----------------------------------------------------------------------------------
    def _status(self) -> control_pb2.Status:
        ctx = self.ctx
        loaded = ctx.manager.loaded()
        status = control_pb2.Status(
            state=ctx.state(), version=ctx.version,
            models=[model_info(e, pool=ctx.pool) for e in loaded],
            memory=memory_figures(ctx.memory_figures()),
            active_requests=sum(e.loop.num_active for e in loaded),
            queued_requests=sum(e.loop.num_queued for e in loaded),
            tokens_per_second=sum(e.loop.tokens_per_second for e in loaded),
            requests_served=sum(e.loop.requests_served for e in loaded),
            last_error=ctx.last_error, cache_resizes=ctx.cache_resizes, http_url=ctx.http_url)
        recent = next((e for e in loaded if e.name == ctx.manager.last_used), loaded[0] if loaded else None)
        if recent is not None:
            status.engine.CopyFrom(engine_figures(recent.stats, recent.loop.kv_figures()))
        return status

    def GetStatus(self, request, context):
        return self._status()

    def WatchStatus(self, request, context):
        interval = request.interval_seconds or 1.0
        if not 0.05 <= interval <= 3600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_seconds must be between 0.05 and 3600")
        ended = threading.Event()
        context.add_callback(ended.set)  # the client went away or cancelled: stop at once, not after interval
        while context.is_active() and not self.ctx.stopping:
            yield self._status()
            if ended.wait(interval) or self.ctx.shutdown_requested.is_set():
                break

    # -- calibration and shutdown --------------------------------------------------------------------
    def Calibrate(self, request, context):
        from moed.experts.calibration import calibrate, save_profile

        try:
            entry = self.ctx.manager.get(request.model)
            device = getattr(entry.runtime.executor, "device", None)
            if device is None:
                raise InvalidRequestError(f"model {entry.name!r} runs on the CPU backend; there is no B_P to measure")
            seconds = request.seconds or 1.0
            if not 0 < seconds <= 60:
                raise InvalidRequestError("seconds must be in (0, 60]")
            future = entry.loop.run_at_safe_point(lambda: calibrate(device, entry.runtime.loaded.bank, seconds=seconds))
            profile = future.result()
            save_profile(profile, entry.runtime.loaded.bank)
        except Exception as exc:  # MoedError -> its status; anything else -> one-line INTERNAL (logged)
            abort_with(context, exc)
        return control_pb2.CalibrateResponse(b_p=profile.b_p, b_h=profile.b_h, b_p_concurrent=profile.b_p_concurrent,
                                             b_h_concurrent=profile.b_h_concurrent, q_ratio=profile.q_ratio,
                                             device=profile.device)

    def Shutdown(self, request, context):
        self.ctx.shutdown_cancel_inflight = bool(request.cancel_inflight)
        self.ctx.shutdown_requested.set()
        return control_pb2.ShutdownResponse()
