"""Run one job (one method on one model, one kind of measurement) and return its result.

Kinds:
- ``memory``: a warm-up step (creates optimizer state), then a measured step; peak bytes
  by category from `MemoryTracker` (tier ``tracked`` on CPU; tier ``measured`` on CUDA,
  where the allocator's peak is the headline and the tracker gives the split; tier
  ``simulated`` with `simulate`: the same step on fake tensors, which hold no memory, so
  paper-sized models can be measured on a laptop).
- ``throughput``: warm-up steps, then timed steps; median step time and tokens/s.
- ``convergence``: `steps` training steps on fresh batches; loss and wall time per step.
- ``capacity``: for each of `memory_gb`, the largest batch (up to `batch_size`) whose
  memory job fits, found by search (`bench.measure.capacity`), in the job's tier.
- ``model_capacity``: for each of `memory_gb`, the largest size of the model's family
  (from `model` up its ladder, `bench.models.ladder`) whose memory job at `batch_size` fits.

Failure is data: running out of memory (real, or over `capacity_gb`), a non-finite loss
and any exception become a result with status ``oom``, ``diverged`` or ``error`` and the
message, never a crash of the caller.
"""
from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
import traceback
from dataclasses import asdict

import torch

from bench import data, models
from bench.measure import allocator, records as results
from bench.measure.tracker import CUDA_BLOCK, CapacityExceeded, MemoryTracker, cuda_kernels, cuda_peak
from bench.method import Method, load
from bench.job import KINDS, Job

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class Diverged(RuntimeError):
    """The loss became NaN or infinite; `partial` keeps what was measured before."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial or {}


def run(job: Job, method: Method | None = None) -> dict:
    """Run `job` and return its result record. `method` replaces loading `job.method`
    (tests use it to run methods that are not modules)."""
    started = time.perf_counter()
    if job.threads:
        torch.set_num_threads(job.threads)
    record = {"schema_version": results.SCHEMA_VERSION, "job": asdict(job), "status": "ok",
              "message": None}
    try:
        if job.kind not in KINDS:
            raise ValueError(f"unknown kind {job.kind!r}; known: {', '.join(KINDS)}")
        method = method or load(job.method, job.hparams)
        record["hparams"] = {k: list(v) if isinstance(v, tuple) else v for k, v in method.hp.items()}
        if job.simulate and (job.kind not in ("memory", "capacity", "model_capacity")
                             or job.device != "cpu"):
            raise ValueError("simulate applies to memory and capacity jobs on the cpu device "
                             "only (fake CUDA tensors need a GPU for backward)")
        if job.kind in ("capacity", "model_capacity"):
            record.update(_capacity(job, method))
            return _finish(record, job, method, started)
        fake = _fake_mode() if job.simulate else None
        model, stream = _setup(job, method, fake)
        record["n_params"] = models.n_params(model)
        if job.kind == "memory":
            record.update(_memory(job, method, model, stream, fake))
        else:
            measure = {"throughput": _throughput, "convergence": _convergence}[job.kind]
            record.update(measure(job, method, model, stream))
    except (CapacityExceeded, torch.OutOfMemoryError) as e:
        record.update(status="oom", message=_first_line(e))
    except Diverged as e:
        record.update(status="diverged", message=str(e), **e.partial)
    except Exception as e:  # failure is data: keep the message, let the DAG go on
        record.update(status="error", message=error_message(e, job.simulate),
                      traceback=traceback.format_exc(limit=-6))
    return _finish(record, job, method, started)


def error_message(e: Exception, simulated: bool) -> str:
    """The one-line message of a failed job; on fake tensors, says when the failure is
    that the step needs a tensor's value (data-dependent ops), which fake tensors lack."""
    message = f"{type(e).__name__}: {_first_line(e)}"
    if simulated:
        from torch._subclasses import fake_tensor

        limits = (fake_tensor.DataDependentOutputException,
                  fake_tensor.DynamicOutputShapeException,
                  fake_tensor.UnsupportedOperatorException)
        if isinstance(e, limits) or "data-dependent" in str(e).lower():
            message = ("cannot run on fake tensors (the simulated tier): the step needs a "
                       f"tensor's value; measure it on real tensors instead ({message})")
    return message


def _finish(record: dict, job: Job, method: Method | None, started: float) -> dict:
    if method is not None and method.report:
        record["method_report"] = method.report
    record["provenance"] = results.provenance(job.device)
    record["wall_time_s"] = time.perf_counter() - started
    return record


def _capacity(job: Job, method: Method) -> dict:
    from bench.measure import capacity

    if not job.memory_gb:
        raise ValueError(f"a {job.kind} job needs memory sizes (memory_gb)")
    unit = method.hp["micro_batches"]
    if job.kind == "capacity":
        found = capacity.search(job, job.memory_gb, job.batch_size, unit)
    else:  # every size runs at the job's batch: check it once, before any is built
        _check_batch(job, method)
        found = capacity.search_model(job, job.memory_gb, unit)
    first = next((r for r in found["runs"] if r.get("n_params") and r["model"] == job.model), {})
    out = {"capacity": found, "n_params": first.get("n_params")}
    if found["error"]:
        out.update(status="error", message=found["error"])
    return out


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_batch(job: Job, method: Method) -> None:
    if job.batch_size % method.hp["micro_batches"]:
        raise ValueError(f"batch size {job.batch_size} is not divisible by micro_batches="
                         f"{method.hp['micro_batches']} of {method.name}")


def _setup(job: Job, method: Method, fake=None):
    models.config_of(job.model)  # a clear error for an unknown name
    _check_batch(job, method)
    if job.seq_len > models.max_positions(job.model):
        raise ValueError(f"seq_len {job.seq_len} exceeds {job.model}'s {models.max_positions(job.model)} positions")
    if job.device.startswith("cuda"):
        # a capacity search runs several jobs in one process: start each from an empty
        # cache, under its own cap (or none)
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(job.device).total_memory
        cap = job.capacity_gb * 2**30 / total if job.capacity_gb else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap), job.device)
    torch.manual_seed(job.seed)
    # Built directly in its dtype and on its device: no copy, and it works on fake tensors.
    with fake or contextlib.nullcontext(), torch.device(job.device), _default_dtype(DTYPES[job.dtype]):
        model = models.build(job.model, job.attn_implementation, job.dropout)
    model = method.transform_model(model)
    model.train()
    task = data.make_task(job.task)
    objective = models.OBJECTIVE[models.family(job.model)]
    stream = data.Stream(task, objective, models.vocab_size(job.model), job.batch_size, job.seq_len, job.seed)
    return model, stream


def _next_batch(stream: data.Stream, device: str) -> dict:
    return {k: v.to(device) for k, v in stream.next().items()}


def _checked(loss: torch.Tensor, step: int) -> float:
    value = float(loss)
    if not math.isfinite(value):
        raise Diverged(f"loss is {value} at step {step}")
    return value


def _memory(job: Job, method: Method, model, stream, fake=None) -> dict:
    cuda = job.device.startswith("cuda") and fake is None
    # a real CPU run is capped by the tracker; a simulated one by the allocator model below
    capped = job.capacity_gb and not cuda and fake is None
    capacity = int(job.capacity_gb * 2**30) if capped else None
    events = [] if fake is not None else None  # the allocation order, for the allocator model
    tracker = MemoryTracker(capacity_bytes=capacity, round_to=CUDA_BLOCK if cuda else 1,
                            events=events)
    raw = [_next_batch(stream, job.device) for _ in range(2)]
    check = _checked if fake is None else (lambda loss, step: None)  # a fake loss has no value
    tracker.register_model(model)

    def next_batch():  # each step's batch exists from its step on, as from a data loader
        batch = raw.pop(0)
        if fake is not None:
            batch = {k: fake.from_tensor(v) for k, v in batch.items()}
        tracker.register(batch.values(), "other")
        return batch

    out = {}
    kernels = contextlib.nullcontext() if cuda else cuda_kernels()
    with fake or contextlib.nullcontext(), tracker, kernels:
        optimizer = method.make_optimizer(model)
        loss = method.train_step(model, optimizer, next_batch())
        tracker.label(method.state_tensors(optimizer), "optimizer")
        check(loss, 0)
        out["first_step_peak_bytes"] = tracker.peak
        del loss  # the measured step starts from the persistent state and its own batch
        batch = next_batch()
        tracker.reset_peak()
        if cuda:
            with cuda_peak() as stats:
                loss = method.train_step(model, optimizer, batch)
        else:
            loss = method.train_step(model, optimizer, batch)
        tracker.label(method.state_tensors(optimizer), "optimizer")
        out["loss"] = check(loss, 1)
    split = tracker.peak_split.as_row()
    tier = "tracked" if fake is None else "simulated"
    out["memory"] = {"tier": tier, **split, "tracked_peak_bytes": split["peak_bytes"]}
    if fake is not None:
        out["memory"].update(_predict_gpu(events, job.capacity_gb))
    if cuda:
        # The allocator's peak is what a GPU needs; what the tracker cannot attribute
        # (allocator rounding beyond 512 B, library workspaces) is counted as other.
        peak = stats["allocated_peak_bytes"]
        known = sum(split[f"{c}_bytes"] for c in ("param", "grad", "optimizer", "activation"))
        out["memory"].update(tier="measured", peak_bytes=peak, other_bytes=peak - known, **stats)
    return out


def _predict_gpu(events: list, capacity_gb: float | None) -> dict:
    """What a CUDA GPU would need for this simulated run: the allocation trace replayed
    through the caching-allocator model, plus the CUDA context; over `capacity_gb`, the
    run is an (predicted) out-of-memory."""
    free_run = allocator.replay(events)
    predicted = {"predicted_allocated_peak_bytes": free_run.allocated_peak_bytes,
                 "reserved_peak_bytes": free_run.reserved_peak_bytes,
                 "context_bytes": allocator.CUDA_CONTEXT_BYTES,
                 "predicted_gpu_bytes": free_run.reserved_peak_bytes + allocator.CUDA_CONTEXT_BYTES}
    if capacity_gb:
        capped = allocator.replay_on_gpu(events, int(capacity_gb * 2**30))
        if not capped.fits:
            raise CapacityExceeded(
                f"predicted out of memory on a {capacity_gb:g} GiB GPU: a {capped.failed_request_bytes:,}"
                f"-byte allocation does not fit (allocator model, {allocator.CUDA_CONTEXT_BYTES:,} "
                f"bytes of CUDA context)")
        predicted["alloc_retries"] = capped.alloc_retries
    else:
        predicted["alloc_retries"] = free_run.alloc_retries
    return predicted


def _throughput(job: Job, method: Method, model, stream) -> dict:
    cuda = job.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    optimizer = method.make_optimizer(model)
    batch = _next_batch(stream, job.device)
    for i in range(job.warmup_steps):
        _checked(method.train_step(model, optimizer, batch), i)
    times = []
    for i in range(job.steps):
        sync()
        t0 = time.perf_counter()
        loss = method.train_step(model, optimizer, batch)
        sync()
        times.append(time.perf_counter() - t0)
        _checked(loss, job.warmup_steps + i)
    quartiles = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    q1, median, q3 = (float(q) for q in torch.tensor(times, dtype=torch.float64).quantile(quartiles))
    tokens = job.batch_size * job.seq_len
    return {"throughput": {"tokens_per_s": tokens / median, "step_time_median_s": median,
                           "step_time_q1_s": q1, "step_time_q3_s": q3, "step_times_s": times,
                           "tokens_per_step": tokens}}


def _convergence(job: Job, method: Method, model, stream) -> dict:
    optimizer = method.make_optimizer(model)
    curve = []
    start = time.perf_counter()
    for step in range(job.steps):
        try:
            loss = _checked(method.train_step(model, optimizer, _next_batch(stream, job.device)), step)
        except Diverged as e:
            raise Diverged(str(e), {"curve": curve, "loss_floor": stream.task.loss_floor}) from None
        curve.append({"step": step + 1, "wall_s": time.perf_counter() - start, "loss": loss})
        if job.log_every and ((step + 1) % job.log_every == 0 or step + 1 == job.steps):
            print(f"[{job.method} {job.model} seed {job.seed}] step {step + 1}/{job.steps} "
                  f"loss {loss:.4f}", file=sys.stderr, flush=True)
    tail = curve[-max(1, job.steps // 10):]
    return {"curve": curve, "final_loss": sum(c["loss"] for c in tail) / len(tail),
            "loss_floor": stream.task.loss_floor}
