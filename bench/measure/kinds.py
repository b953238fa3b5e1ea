"""The measurement of each kind of job on a built model: memory (peak bytes by category over
a warm-up and a measured step), throughput (timed steps) and convergence (loss per step).
`measure(job, method)` builds the model and runs the job's kind; `attempt` turns any
failure into a result (status oom, diverged or error, with the message)."""
from __future__ import annotations

import contextlib
import sys
import time
import traceback

import torch

from bench import models
from bench.errors import first_line
from bench.job import Job
from bench.measure import step, timing
from bench.measure.step import Diverged, TimedOut, checked, predict_gpu
from bench.measure.allocator import MIN_BLOCK
from bench.measure.cost import StepCost
from bench.measure.tracker import CapacityExceeded, MemoryTracker, cuda_kernels, cuda_peak
from bench.method import Method, load


def measure(job: Job, method: Method) -> dict:
    """Build the job's model and data, and run its kind (memory, throughput, convergence)."""
    if job.kind == "throughput":  # builds its own pair of models
        return _throughput(job, method)
    fake = step.fake_mode() if job.simulate else None
    model, stream = step.setup(job, method, fake)
    out = {"n_params": models.n_params(model), "trainable_params": trainable_params(model)}
    if job.kind == "memory":
        out.update(_memory(job, method, model, stream, fake))
    else:
        out.update(_convergence(job, method, model, stream))
    out.update(step.loss_scaler_record(model, method))  # float16: the scaling the step ran
    return out


def attempt(job: Job, fn) -> dict:
    """`fn()`'s result with status ok, or the failure as data: out of memory (real, or over
    `capacity_gb`), a non-finite loss, the job's time limit and any exception become status
    oom, diverged, timeout or error with the message (and what a diverged or timed-out
    convergence run had measured), never a crash of the caller."""
    record = {"status": "ok", "message": None}
    try:
        record.update(fn())
    except (CapacityExceeded, torch.OutOfMemoryError) as e:
        record.update(status="oom", message=first_line(e))
    except Diverged as e:
        record.update(status="diverged", message=str(e), **e.partial)
    except TimedOut as e:
        record.update(status="timeout", message=str(e), **e.partial)
    except Exception as e:  # failure is data: keep the message, let the DAG go on
        record.update(status="error", message=step.error_message(e, job.simulate),
                      traceback=traceback.format_exc(limit=-6))
    return record


def _memory(job: Job, method: Method, model, stream, fake=None) -> dict:
    cuda = job.device.startswith("cuda") and fake is None
    # a real CPU run is capped by the tracker; a simulated one by the allocator model below
    capped = job.capacity_gb and not cuda and fake is None
    capacity = int(job.capacity_gb * 2**30) if capped else None
    events = [] if fake is not None else None  # the allocation order, for the allocator model
    tracker = MemoryTracker(capacity_bytes=capacity, round_to=MIN_BLOCK if cuda else 1,
                            events=events, device=job.device if fake is None else "cpu")
    raw = [step.next_batch(stream, job.device) for _ in range(2)]
    check = checked if fake is None else (lambda loss, step: None)  # a fake loss has no value
    tracker.register_model(model)

    def take_batch():  # each step's batch exists from its step on, as from a data loader
        batch = raw.pop(0)
        if fake is not None:
            batch = {k: fake.from_tensor(v) for k, v in batch.items()}
        tracker.register(batch.values(), "other")
        return batch

    out = {}
    kernels = contextlib.nullcontext() if cuda else cuda_kernels()
    with fake or contextlib.nullcontext(), tracker, kernels:
        optimizer = method.make_optimizer(model)
        loss = method.train_step(model, optimizer, take_batch())
        tracker.label(method.state_tensors(optimizer), "optimizer")
        check(loss, 0)
        out["first_step_peak_bytes"] = tracker.peak
        del loss  # the measured step starts from the persistent state and its own batch
        batch = take_batch()
        tracker.reset_peak()
        with StepCost() as cost:  # the measured step's FLOPs, bytes and ops (bench.measure.cost)
            if cuda:
                with cuda_peak() as stats:
                    loss = method.train_step(model, optimizer, batch)
            else:
                loss = method.train_step(model, optimizer, batch)
        tracker.label(method.state_tensors(optimizer), "optimizer")
        out["loss"] = check(loss, 1)
    cost.add_periodic(optimizer)
    out["cost"] = cost.result()
    split = tracker.peak_split.as_row()
    tier = "tracked" if fake is None else "simulated"
    # host memory beside the device's: what offloading keeps there, and moves each step
    out["memory"] = {"tier": tier, **split, "tracked_peak_bytes": split["peak_bytes"], **tracker.host_row()}
    if fake is not None:
        out["memory"].update(predict_gpu(events, job.capacity_gb))
    if cuda:
        # The allocator's peak is what a GPU needs; what the tracker cannot attribute
        # (allocator rounding beyond 512 B, library workspaces) is counted as other.
        peak = stats["allocated_peak_bytes"]
        known = sum(split[f"{c}_bytes"] for c in ("param", "grad", "optimizer", "activation"))
        out["memory"].update(tier="measured", peak_bytes=peak, other_bytes=peak - known, **stats)
    return out


def _throughput(job: Job, method: Method) -> dict:
    """The method and its baseline timed side by side in one process (bench.measure.timing)."""
    result = throughput_panel([(job, method)])[0]
    if isinstance(result, Exception):
        raise result
    return result


def throughput_panel(entries: list[tuple[Job, Method]]) -> list[dict | Exception]:
    """Several throughput jobs that differ only in their method, timed in one set of
    interleaved rounds beside one baseline (the first job's settings, its `baseline`;
    `timing.interleave` pairs each method block with an adjacent baseline block):
    per job, its result, or the exception it failed with (building, warming up or in a
    round; the others go on). A failure of the baseline fails them all."""
    job = entries[0][0]
    cuda = job.device.startswith("cuda")
    # a fresh instance, even when a method is paired with itself (methods keep state), with
    # that job's hyperparameters
    same = [j.hparams for j, _ in entries if j.method == job.baseline]
    baseline = load(job.baseline, same[0] if same else None)
    built: list = []  # per entry: its Side, or the exception that stopped it
    n_params, park = [], False
    for j, m, name in [*((j, m, j.method) for j, m in entries), (job, baseline, job.baseline)]:
        try:  # same seed: the same initial weights and batch on every side
            side, n = _side(j, m, name)
            if cuda and not built:  # after the first side's warm-up
                park = timing.must_park(job.device)
            if park:  # one side on the GPU at a time: the others wait in host memory
                side.park("cpu")
        except Exception as e:
            side, n = e, None
        built.append(side)
        n_params.append(n)
    base = built.pop()
    if isinstance(base, Exception):
        return [base] * len(entries)
    sides = [s for s in built if not isinstance(s, Exception)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rounds = job.rounds
    tag = f"[throughput {job.model}: {len(sides)} method{'s' if len(sides) > 1 else ''} beside {job.baseline}]"
    every = max(1, rounds // 4)
    # the rounds in segments, each on a fresh memory layout: the interval covers what
    # changes between runs of the job, not only between neighbouring rounds
    timing.interleave(sides, base, rounds, max(1, job.steps // rounds), seed=job.seed, sync=sync,
                      park_to="cpu" if park else None, home=job.device, segments=timing.SEGMENTS,
                      check=lambda loss, r: checked(loss, job.warmup_steps + r),
                      progress=lambda r: (r + 1) % every == 0 and print(
                          f"{tag} round {r + 1}/{rounds}", file=sys.stderr, flush=True))
    if base.error is not None:
        return [base.error] * len(entries)
    out = []
    for (j, m), side, n in zip(entries, built, n_params):
        if isinstance(side, Exception) or side.error is not None:
            out.append(side if isinstance(side, Exception) else side.error)
            continue
        out.append({"n_params": n[0], "trainable_params": n[1],
                    "throughput": {**timing.summary(side, base, j.batch_size * j.seq_len, j.seed, j.between_runs_sd),
                                   "parked": park, "panel_size": len(entries)}})
    return out


def _side(job: Job, method: Method, name: str) -> tuple[timing.Side, tuple[int, int]]:
    """A method's model, optimizer and batch, warmed up, as one side of a timed pair."""
    model, stream = step.setup(job, method)
    optimizer = method.make_optimizer(model)
    batch = step.next_batch(stream, job.device)

    def one_step():
        return method.train_step(model, optimizer, batch)

    def tensors():
        return ([*model.parameters(), *model.buffers(), *method.state_tensors(optimizer)]
                + [p.grad for p in model.parameters() if p.grad is not None])

    side = timing.Side(name, one_step, tensors)  # tensors: to park it (CUDA), to relay it out
    for i in range(job.warmup_steps):
        checked(side.step(), i)
    return side, (models.n_params(model), trainable_params(model))


def trainable_params(model) -> int:
    """Parameters the step trains (requires_grad after the method's transform_model): all
    of them unless the method freezes some (LoRA trains its adapters only)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _convergence(job: Job, method: Method, model, stream) -> dict:
    optimizer = method.make_optimizer(model)
    curve = []
    start = time.perf_counter()
    for i in range(job.steps):
        try:
            loss = checked(method.train_step(model, optimizer, step.next_batch(stream, job.device)), i)
        except (Diverged, TimedOut) as e:
            e.partial = {"curve": curve, "loss_floor": stream.task.loss_floor}
            raise
        curve.append({"step": i + 1, "wall_s": time.perf_counter() - start, "loss": loss})
        if job.log_every and ((i + 1) % job.log_every == 0 or i + 1 == job.steps):
            print(f"[{job.method} {job.model} seed {job.seed}] step {i + 1}/{job.steps} "
                  f"loss {loss:.4f}", file=sys.stderr, flush=True)
    tail = curve[-max(1, job.steps // 10):]
    out = {"curve": curve, "final_loss": sum(c["loss"] for c in tail) / len(tail),
           "loss_floor": stream.task.loss_floor}
    if job.save_weights:  # written beside the result by whoever writes it (bench.run.write_one)
        out["weights"] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return out
