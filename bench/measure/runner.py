"""Run one job (one method on one model, one kind of measurement) and return its result.

Kinds:
- ``memory``: a warm-up step (creates optimizer state), then a measured step; peak bytes
  by category from `MemoryTracker` (tier ``tracked`` on CPU; tier ``measured`` on CUDA,
  where the allocator's peak is the headline and the tracker gives the split; tier
  ``simulated`` with `simulate`: the same step on fake tensors, which hold no memory, so
  paper-sized models can be measured on a laptop). With `world_size` and `sharding`: one
  rank's memory under data parallelism (`none`: DDP-style replicas, the single-rank
  numbers; `fsdp`: FSDP2, `bench.measure.sharded`; docs/sharding.md).
- ``throughput``: warm-up steps, then timed steps beside the baseline's, in interleaved
  rounds; the ratio of their tokens/s with a 95% interval. `run_panel` times several
  methods beside one baseline in the same rounds.
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

import dataclasses
import functools
import time

import torch

from bench import tuning
from bench.job import KINDS, Job
from bench.measure import capacity, kinds, records, step
from bench.method import Method, load


def run(job: Job, method: Method | None = None) -> dict:
    """Run `job` and return its result record. `method` replaces loading `job.method`
    (tests use it to run methods that are not modules)."""
    started = time.perf_counter()
    if job.threads:
        torch.set_num_threads(job.threads)
    record = {"schema_version": records.SCHEMA_VERSION, "job": job.to_dict()}
    loaded = []

    def measure() -> dict:
        if job.kind not in KINDS:
            raise ValueError(f"unknown kind {job.kind!r}; known: {', '.join(KINDS)}")
        overrides = dict(job.hparams)
        if job.tuned_from:  # the learning rate its tuning runs chose (bench/tuning.py)
            record["tuning"] = tuning.chosen(job.tuned_from)
            if record["tuning"]["lr"] is None:
                raise step.Diverged("every learning rate of the tuning grid failed on the tuning seeds: "
                                    + ", ".join(f"{e['lr']:g} {'/'.join(e['statuses'])}"
                                                for e in record["tuning"]["grid"]))
            overrides["lr"] = record["tuning"]["lr"]
        elif job.lr is not None:
            overrides["lr"] = job.lr
        m = method or load(job.method, overrides)
        loaded.append(m)
        record["hparams"] = _hparams(m)
        if job.simulate and (job.kind not in ("memory", "capacity", "model_capacity")
                             or job.device != "cpu"):
            raise ValueError("simulate applies to memory and capacity jobs on the cpu device "
                             "only (fake CUDA tensors need a GPU for backward)")
        problem = kinds.sharding_problem(job.kind, job.world_size, job.sharding, job.simulate, job.device)
        if problem:  # data parallelism: memory jobs only, the schemes wired (kinds.SHARDED)
            raise ValueError(problem[1])
        if job.kind in ("capacity", "model_capacity"):
            return _capacity(job, m)
        return kinds.measure(job, m)

    with step.time_limit(job.time_limit()):
        record.update(kinds.attempt(job, measure))
    return _finish(record, job, loaded[0] if loaded else None, started)


def run_panel(jobs: list[Job]) -> list[dict]:
    """Result records of throughput jobs that differ only in their method, timed together
    beside one baseline (`kinds.throughput_panel`); each record as `run` would write it,
    its `wall_time_s` the panel's divided by the number of jobs."""
    started = time.perf_counter()
    if jobs[0].threads:
        torch.set_num_threads(jobs[0].threads)
    methods = [load(job.method, job.hparams) for job in jobs]
    try:  # the panel may run as long as its jobs together
        with step.time_limit(sum(job.time_limit() for job in jobs)):
            outcomes = kinds.throughput_panel(list(zip(jobs, methods)))
    except step.TimedOut as e:
        outcomes = [e] * len(jobs)
    out = []
    for job, m, outcome in zip(jobs, methods, outcomes):
        record = {"schema_version": records.SCHEMA_VERSION, "job": job.to_dict(),
                  "hparams": _hparams(m)}

        def result(outcome=outcome):
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        record.update(kinds.attempt(job, result))
        out.append(_finish(record, job, m, started))
    for record in out:
        record["wall_time_s"] /= len(out)
    return out


def _hparams(method: Method) -> dict:
    """The method's hyperparameters as the result records them (tuples as JSON lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in method.hp.items()}


def _finish(record: dict, job: Job, method: Method | None, started: float) -> dict:
    if method is not None and method.report:
        record["method_report"] = method.report
    record["provenance"] = records.provenance(job.device)
    record["wall_time_s"] = time.perf_counter() - started
    return record


def _capacity(job: Job, method: Method) -> dict:
    if not job.memory_gb:
        raise ValueError(f"a {job.kind} job needs memory sizes (memory_gb)")
    unit = method.hp["micro_batches"]
    if job.kind == "capacity":
        found = capacity.search(job, job.memory_gb, job.batch_size, unit)
    else:  # every size runs at the job's batch: check it once, before any is built
        step.check_batch(job, method)
        found = capacity.search_model(job, job.memory_gb, unit)
    first = next((r for r in found["runs"] if r.get("n_params") and r["model"] == job.model), {})
    out = {"capacity": found, "n_params": first.get("n_params")}
    if found["error"]:
        out.update(status="error", message=found["error"])
    return out




# host memory a panel's sides may hold together (parameters, gradients, two moments each)
PANEL_BYTES = 2 * 2**30


def panels(jobs: list[Job]) -> list[list[int]]:
    """`jobs`' indices in batches run together: CPU throughput jobs that differ only in
    their method form one panel (timed beside one baseline, `run_panel`), as many as fit
    in PANEL_BYTES; every other job runs alone. Batches in the order of their first job."""
    open_panel: dict[tuple, list[int]] = {}  # panel key -> the batch still filling
    out: list[list[int]] = []
    for i, job in enumerate(jobs):
        if job.kind != "throughput" or job.device != "cpu":
            out.append([i])
            continue
        fields = dataclasses.asdict(job)
        key = tuple((k, repr(v)) for k, v in fields.items() if k not in ("method", "hparams"))
        batch = open_panel.get(key)
        if batch is None or (len(batch) + 2) * 16 * _n_params(job.model, job.attn_implementation) > PANEL_BYTES:
            batch = open_panel[key] = []
            out.append(batch)
        batch.append(i)
    return out


@functools.cache
def _n_params(model: str, attn_implementation: str) -> int:
    from bench import models

    with torch.device("meta"):
        return models.n_params(models.build(model, attn_implementation))
