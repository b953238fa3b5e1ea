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
    """Build the job's model and data, and run its kind (memory, throughput, convergence).
    A memory job with a sharding scheme is measured by the scheme's own code (`SHARDED`)."""
    problem = sharding_problem(job.kind, job.world_size, job.sharding, job.simulate, job.device)
    if problem:
        raise ValueError(problem[1])
    if job.kind == "memory" and job.sharding != "none":
        if not can_shard(method, job.sharding):
            raise ValueError(f"{job.method} cannot run sharded (sharding {job.sharding}; its `shards` "
                             f"declaration, docs/sharding.md)")
        return SHARDED[job.sharding](job, method)
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
    if job.kind == "memory" and job.world_size > 1:  # sharding none: DDP-style replicas
        from bench.measure import collectives

        params = [(p.numel(), p.element_size(), p.requires_grad) for p in model.parameters()]
        out["sharding"] = {"scheme": "none", "world_size": job.world_size, "rank": 0, "bytes": 0,
                           "max_rank_peak_bytes": out["memory"]["peak_bytes"], "max_rank_basis": "replicas",
                           "note": REPLICAS_NOTE,
                           "collectives": collectives.replicas(params, job.world_size, method.hp["micro_batches"])}
    return out


# -- data parallelism (the job's world_size and sharding; docs/sharding.md) -----------------
REPLICAS_NOTE = ("DDP-style replicas: every rank holds the whole model, its gradients and optimizer "
                 "state, so a rank's memory is the single-rank job's; DDP's gradient all-reduce "
                 "buckets are not modelled")
MAX_REAL_RANKS = 4  # a real (tracked) sharded run: one process per rank on this machine


def _fsdp(job: Job, method: Method) -> dict:
    """A memory job under FSDP2 (`bench.measure.sharded`). Simulated: rank 0 of world_size
    on fake tensors, in this process; under FSDP2 rank 0 holds the most (every rank keeps
    parameter and gradient buffers of the same padded size; rank 0 always owns a whole
    chunk of rows, so the most optimizer state), so its peak is the largest rank's.
    Tracked: world_size gloo processes, every rank measured; rank 0's split, and every
    rank's peak (`rank_peaks_bytes`). `method` is rank 0's (the processes load their own)."""
    from bench.measure import collectives, sharded

    if job.simulate:
        ranks = [sharded.measure_rank(job, method, job.world_size, 0)]
        peaks = None
    else:
        ranks = sharded.run_ranks(job, job.world_size, threads=job.threads or 1)
        peaks = [r["memory"]["peak_bytes"] for r in ranks]
    first = ranks[0]
    moved = None  # the step's all-gathers and reduce-scatters, from the shards
    if first.get("shards"):
        frozen = first["trainable_params"] < first["n_params"]  # only the trainable gradients are reduced
        moved = collectives.fsdp(first["shards"], job.world_size, method.hp["micro_batches"],
                                 grad_shard_bytes=(first["before_update"] or {}).get("grad") if frozen else None,
                                 gather_itemsize=step.DTYPES[job.dtype].itemsize if job.precision == "mixed" else None)
    return {"n_params": first["n_params"], "trainable_params": first["trainable_params"],
            "memory": first["memory"], "first_step_peak_bytes": first["first_step_peak_bytes"],
            "loss": first["loss"], "before_update": first["before_update"], "after_step": first["after_step"],
            "sharding": {"scheme": "fsdp", "world_size": job.world_size, "rank": 0, **first["sharding"],
                         "rank_peaks_bytes": peaks,
                         "max_rank_peak_bytes": max(peaks) if peaks else first["memory"]["peak_bytes"],
                         "max_rank_basis": "every rank measured" if peaks else "rank 0 holds the most",
                         "collectives": moved}}


def _zero(job: Job, method: Method) -> dict:
    """A memory job under DeepSpeed ZeRO (stage from `job.sharding`), modelled
    (`bench.measure.zero`): the job's two steps run once on one rank (on fake tensors if
    `simulate`), then the timeline is replayed with ZeRO's partitioning at world_size: rank
    0's split (tier "modelled", not a run), and the largest rank's peak (stage 1 and 2 keep
    the whole gradient of every parameter that overlaps a rank's partition, so ranks differ)."""
    from bench.measure import collectives, zero

    timeline = zero.record_timeline(job, method)
    cfg = zero.ZeroConfig(stage=int(job.sharding[-1]), world_size=job.world_size)
    ranks = zero.model_ranks(timeline, cfg)
    first, largest = ranks["rank0"], ranks["max"]
    memory = {**first["memory"], "tracked_peak_bytes": first["memory"]["peak_bytes"],
              "from_tier": "simulated" if job.simulate else "tracked"}
    return {"n_params": timeline.unsharded["n_params"], "memory": memory, "before_update": first["before_update"],
            "sharding": {"scheme": job.sharding, "world_size": job.world_size, "rank": 0, **first["sharding"],
                         "max_rank": largest["rank"], "max_rank_peak_bytes": largest["memory"]["peak_bytes"],
                         "max_rank_basis": "modelled for every rank (rank 0 and the last beyond 64)",
                         "config": first["config"], "deepspeed_version": first["deepspeed_version"],
                         "collectives": collectives.zero_stage(timeline.params, cfg, method.hp["micro_batches"])}}


# Scheme -> how a memory job measures it: the one place a scheme is switched on. FSDP2 is
# a run (real gloo processes, or simulated); ZeRO is a model of DeepSpeed's partitioning
# replayed over one rank's timeline (docs/sharding.md says which rows are which).
SHARDED = {"fsdp": _fsdp, "zero1": _zero, "zero2": _zero, "zero3": _zero}


def can_shard(method: Method, scheme: str) -> bool:
    """Whether `method` (each member of a stack) runs under the data-parallel `scheme`: its
    `shards` is True, or a tuple naming the scheme ("none", replicas, always can)."""
    if scheme == "none":
        return True
    return all(m.shards is True or (isinstance(m.shards, tuple) and scheme in m.shards)
               for m in getattr(method, "members", [method]))


def sharding_problem(kind: str, world_size: int, sharding: str, simulate: bool,
                     device: str) -> tuple[str, str] | None:
    """(the job field at fault, why) if a job cannot have this data-parallel setting, else
    None. The config check asks before any job (naming the key), `measure` again."""
    if world_size == 1 and sharding == "none":
        return None
    if kind not in ("memory", "model_capacity"):
        field, value = ("sharding", sharding) if sharding != "none" else ("world_size", world_size)
        return field, (f"{field} {value} applies to memory jobs only, not to {kind} jobs (and to a "
                       f"model_capacity search, whose runs are memory jobs)")
    if sharding == "none":
        return None  # DDP-style replicas: the single-rank job's memory (REPLICAS_NOTE)
    if sharding not in SHARDED:
        return "sharding", f"sharding {sharding}: no code measures or models it (kinds.SHARDED)"
    if kind == "model_capacity" and not simulate:
        return "simulate", (f"sharding {sharding}: a model capacity search under sharding runs simulated (fake "
                            f"tensors, bench.measure.capacity): simulate: true")
    if device != "cpu":
        return "device", (f"sharding {sharding} runs on the cpu device (real gloo processes, or simulated "
                          f"on fake tensors standing for any GPU), not {device}")
    if sharding == "fsdp" and not simulate and world_size > MAX_REAL_RANKS:
        return "world_size", (f"world_size {world_size}: a real (tracked) sharded run spawns one process "
                              f"per rank on this machine, at most {MAX_REAL_RANKS}; simulate: true "
                              f"measures any world size up to 1024")
    return None


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
    take_batch = step.batch_feeder(stream, job.device, fake, tracker)
    check = checked if fake is None else (lambda loss, step: None)  # a fake loss has no value
    tracker.register_model(model)

    out = {}
    cost, stats = StepCost(), {}  # the measured step's FLOPs, bytes and ops (bench.measure.cost)

    def warmed_up():
        out["first_step_peak_bytes"] = tracker.peak

    @contextlib.contextmanager
    def measured():
        with cost, cuda_peak() if cuda else contextlib.nullcontext({}) as peak:
            yield
        stats.update(peak)  # filled as the CUDA peak's block ends

    kernels = contextlib.nullcontext() if cuda else cuda_kernels()
    with fake or contextlib.nullcontext(), tracker, kernels:
        optimizer, loss = step.memory_steps(method, model, tracker, take_batch, check=check,
                                            after_warm_up=warmed_up, measured=measured())
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
