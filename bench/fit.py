"""Does my model fit on my GPU? One command: `membench fit` (or `python -m bench fit`).

    membench fit --model path/to/config.json --batch-size 8 --seq-len 512 --memory-gb 24 80

For each method (default: every method that runs on fake tensors) it runs the model's
training step on fake tensors (the simulated tier: no memory is allocated, so a 7B model
is answered on a laptop) and prints, per GPU memory size, a table: the step's peak by
category, the GPU memory it is predicted to need (the allocation trace replayed through the
model of CUDA's caching allocator, plus the CUDA context), whether it fits, and the largest
batch that fits. `--json FILE` writes the same rows.

The model is a suite name, a shape name (`llama-d3072-l28`) or the path of a Hugging Face
config.json of any architecture transformers builds from its config (`bench.models`).

It is the machinery of the capacity kind (`bench.measure.capacity`): the step at
`--batch-size`, then the largest-batch search, each batch a memory job on fake tensors (a
fresh model, a warm-up step and the measured step at that batch, as a training run's first
two steps), whose trace answers every memory size by being replayed under that size. The search
starts from a line through two points it already has: the step at `--batch-size` and the
state that persists between steps (a batch of zero); it steers by the smallest GPU each
run's trace replays on (`smallest_gpu`: under a cap the allocator frees its cache and
retries, so the unlimited reserve overstates what fits). The boundary (the largest batch
fits and the next one does not) is answered as every batch is: by a step run, or,
between batches whose steps' traces lie on one line in the batch (three of them, byte for
byte: `bench.measure.trace_line`), by the trace that line gives, which is the one the step
would make; so a step well beyond the largest size's answer
(twice a first guess) is run early, and the boundaries below it are computed, not run.
A model of 16 blocks or more (one GPU, rank 0 under FSDP2, or ZeRO's unsharded timeline)
is not run at full depth where its copies give it: at the first batch, copies with 3, 4 and
6 blocks give a rule for the full model's trace (each copy's trace given back byte for byte), and
later batches are read from the copy of 4 blocks (`bench.measure.trace_depth`;
`capacity._Deep`, `capacity._DeepTimelines`). The steps count no FLOPs (fit reports
none; `StepCost` would cost a dispatch mode per operator).

Methods are answered in `--jobs` worker processes (default: one per core this process may
use), each importing torch once and answering one method after another; a method's job
description (`tasks`: `answer`'s arguments as a dict) is all a worker receives. Their
progress lines come to this process's stderr as they are printed; the rows keep the order
the methods were asked in, and a method's rows are the same from any worker.

A model that cannot be built, or whose step fails for every method, is one line on stderr
naming why, and exit code 2. A method that fails alone is a row with its message.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import threading
import time

from bench import models
from bench.errors import first_line
from bench.job import CATEGORIES, DTYPE_NAMES, PROPERTIES, Job

GiB = 2**30

# `membench fit`'s defaults, stated once (its flags, `run` and `answer` take them from here).
# They differ from a suite job's (config/schema.yaml) on purpose: fit asks about a model of
# the papers' size on a GPU, so bfloat16 (how such models train; a CPU job's is float32),
# a step of 8 x 512 tokens, the four usual GPU sizes, and a search up to batch 4096 (a
# suite's capacity search stops at 1024; a 24-80 GiB GPU fits more sequences of a small model).
FIT_DEFAULTS = dict(batch_size=8, seq_len=512, dtype="bfloat16", precision="pure",
                    memory_gb=[16, 24, 40, 80], max_batch=4096, attn_implementation="sdpa", seed=0,
                    gpus=[1], sharding=["fsdp"])


class FitError(Exception):
    """What makes the whole question unanswerable (a model that cannot be built, ...)."""


def parser() -> argparse.ArgumentParser:
    def number(kind, least, above=False):
        """An argparse type: a `kind` number at least `least` (above it, if `above`), finite;
        the bounds are the suite's (config/schema.yaml): what it rejects, fit rejects."""
        bound = f"above {least}" if above else f"at least {least}"

        def parse(text: str):
            try:
                value = kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{'an integer' if kind is int else 'a number'} {bound} is needed, "
                    f"not {text!r}") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise argparse.ArgumentTypeError(f"must be a finite number {bound}, not {text}")
            if not (value > least if above else value >= least):
                raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
            return value

        parse.__name__ = kind.__name__
        return parse

    p = argparse.ArgumentParser(
        prog="membench fit",
        description="Does the model train on a GPU of each memory size, per method? Runs each "
                    "method's training step on fake tensors (nothing is allocated) and prints, "
                    "per memory size, the peak by category, the GPU memory predicted (CUDA "
                    "caching-allocator model plus context), whether it fits and the largest "
                    "batch that does. Progress goes to stderr, one line per step run.")
    p.add_argument("--model", required=True,
                   help="a suite model (e.g. llama-7b), a shape (llama-d3072-l28) or the path of "
                        "a Hugging Face config.json (any architecture transformers builds offline)")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="methods to answer for (stacks with '+', variants with '@'); default: "
                        "every method that runs on fake tensors but the peers (published packages "
                        "whose memory equals their twin's, by test: name one to see it)")
    d, least = FIT_DEFAULTS, {k: PROPERTIES[k]["minimum"] for k in ("batch_size", "seq_len", "seed")}
    p.add_argument("--batch-size", type=number(int, least["batch_size"]), default=d["batch_size"],
                   help="sequences per optimizer step (default %(default)s)")
    p.add_argument("--seq-len", type=number(int, least["seq_len"]), default=d["seq_len"],
                   help="tokens per sequence (default %(default)s)")
    p.add_argument("--dtype", default=d["dtype"], choices=DTYPE_NAMES,
                   help="pure precision: the dtype of parameters, gradients, optimizer state and "
                        "compute; mixed: the compute dtype under autocast (default %(default)s)")
    p.add_argument("--precision", default=d["precision"], choices=PROPERTIES["precision"]["enum"],
                   help="pure: everything in --dtype; mixed: float32 parameters (the master copy), "
                        "gradients and optimizer state, the forward under autocast in --dtype "
                        "(bfloat16 or float16) (default %(default)s)")
    p.add_argument("--memory-gb", type=number(float, 0, above=True), nargs="+",
                   default=d["memory_gb"], metavar="GB",
                   help="GPU memory sizes in GiB (default " + " ".join(map(str, d["memory_gb"])) + ")")
    p.add_argument("--gpus", type=number(int, 1), nargs="+", default=d["gpus"], metavar="N",
                   help="GPU counts (data-parallel ranks, at most 1024): above 1, each is answered under "
                        "every --sharding scheme, per GPU (default " + " ".join(map(str, d["gpus"])) + ")")
    p.add_argument("--sharding", nargs="+", default=d["sharding"], metavar="SCHEME",
                   choices=PROPERTIES["sharding"]["enum"],
                   help="how the GPUs share the training state where --gpus is above 1: fsdp (FSDP2 "
                        "fully_shard per block, simulated: rank 0, which holds the most), zero1, zero2, "
                        "zero3 (DeepSpeed ZeRO, modelled from one rank's timeline: the largest rank), none "
                        "(DDP-style replicas: one GPU's answer) (default %(default)s; docs/sharding.md)")
    p.add_argument("--max-batch", type=number(int, 1), default=d["max_batch"],
                   help="the largest batch the search tries (default %(default)s)")
    p.add_argument("--attn-implementation", default=d["attn_implementation"],
                   choices=PROPERTIES["attn_implementation"]["enum"])
    p.add_argument("--seed", type=number(int, least["seed"]), default=d["seed"])
    p.add_argument("--jobs", type=number(int, 1), default=default_jobs(), metavar="N",
                   help="methods answered at once, each in a worker process (default: the cores "
                        "this process may use, %(default)s)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    return p


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def simulable_methods() -> list[str]:
    """Every method whose class does not declare `simulates = False`, but the peers (a
    published package run to check one of ours, `peer_of`: the same memory, by test)."""
    from bench.method import available

    out = []
    for name in available():
        try:
            cls = importlib.import_module(f"methods.{name}").METHOD
        except Exception:  # noqa: BLE001 - listed; its row then says why it cannot load
            out.append(name)
            continue
        if getattr(cls, "simulates", True) and not getattr(cls, "peer_of", None):
            out.append(name)
    return out


def check_model(name: str, seq_len: int, attn_implementation: str) -> int:
    """The model's parameter count, from a build on the meta device; FitError naming why
    when it cannot be built."""
    import os

    import torch

    if name.endswith(".json") and not os.path.isfile(name):
        raise FitError(f"{name}: no such config.json file")
    try:
        models.config_of(name)
        with torch.device("meta"):
            n = models.n_params(models.build(name, attn_implementation))
    except KeyError as e:
        raise FitError(e.args[0] if e.args else str(e)) from None
    except Exception as e:  # noqa: BLE001 - the one line is the answer
        raise FitError(_line(e)) from None
    if seq_len > models.max_positions(name):
        raise FitError(f"seq_len {seq_len} exceeds {name}'s {models.max_positions(name)} positions")
    return n


def _line(e: BaseException) -> str:
    return first_line(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {first_line(e)}"


def answer(model: str, method: str, memory_gb: list[float], batch_size: int, seq_len: int,
           dtype: str, max_batch: int, seed: int = FIT_DEFAULTS["seed"],
           attn_implementation: str = FIT_DEFAULTS["attn_implementation"],
           label: str | None = None, precision: str = FIT_DEFAULTS["precision"],
           world_size: int = 1, sharding: str = "none") -> list[dict]:
    """One row per memory size for `method` on one of `world_size` GPUs under `sharding`:
    the simulated step at `batch_size` (its peak by category, the GPU need), whether it
    fits, and the largest batch that fits (per GPU: every rank trains on `batch_size`)."""
    from bench.measure import capacity, kinds
    from bench.method import load

    label = label or method
    started = time.perf_counter()
    job = Job(kind="memory", method=method, model=model, batch_size=batch_size, seq_len=seq_len,
              dtype=dtype, precision=precision, seed=seed, attn_implementation=attn_implementation,
              simulate=True, world_size=world_size, sharding=sharding if world_size > 1 else "none")
    base = {"model": model, "method": method, "world_size": world_size, "sharding": job.sharding,
            "batch_size": batch_size, "seq_len": seq_len,
            "dtype": dtype, "precision": precision, "n_params": None, "status": "ok", "message": None, "fits": False,
            "predicted_gpu_bytes": None, "largest_batch": None}

    def failed(message: str) -> list[dict]:
        print(f"{label} error: {message}", file=sys.stderr, flush=True)
        return error_rows(base, memory_gb, message)

    try:
        loaded = load(method)
    except Exception as e:  # noqa: BLE001 - a method that cannot load is a row
        return failed(_line(e))
    if not getattr(loaded, "simulates", True):
        return failed(f"cannot run on fake tensors (the simulated tier): {method} declares "
                      f"simulates = False; measure it on real tensors instead")
    if not kinds.can_shard(loaded, job.sharding):
        return failed(f"cannot run sharded (sharding {job.sharding}): {method} declares `shards` "
                      f"without it (docs/sharding.md)")
    unit = loaded.hp["micro_batches"]
    if batch_size % unit:
        return failed(f"batch size {batch_size} is not divisible by micro_batches={unit} of {method}")
    print(f"{label} {model} on fake tensors" + (f" ({job.sharding}, rank 0 of {world_size})"
                                                  if job.sharding == "fsdp" else "")
          + ", each batch a memory job (a fresh model, a warm-up step and the step at that batch)"
          + (f", modelled under {job.sharding} on {world_size} ranks" if job.sharding.startswith("zero") else ""),
          file=sys.stderr, flush=True)
    oracle = capacity.Oracle(job, unit, log_prefix=label, cost=False)  # rows hold no FLOPs
    try:
        return _search(oracle, job, base, memory_gb, batch_size, max_batch, unit, label, started, failed)
    finally:
        oracle.close()


def _search(oracle, job: Job, base: dict, memory_gb: list[float], batch_size: int, max_batch: int, unit: int,
            label: str, started: float, failed) -> list[dict]:
    """`answer`'s rows from its oracle: the step at `batch_size`, then the largest batch per size."""
    from bench.measure import allocator, capacity

    oracle.need(batch_size)
    record = oracle.records[batch_size]
    if record["status"] != "ok":
        return failed(record["message"])
    memory = record["memory"]
    sim = oracle.sim
    # what a GPU keeps between steps: after the warm-up, or as the ZeRO model counts it
    persistent = (record.get("persistent_bytes")
                  or sum(n for _, n in sim.prefix_live.values()) + allocator.CUDA_CONTEXT_BYTES)
    most = max(1, max_batch // unit)

    needs: dict[int, tuple] = {}  # batch -> (its record, the smallest GPU its trace fits on)

    def known() -> dict:  # k micro-batch units -> bytes; k = 0: the state kept between steps
        for b, r in oracle.records.items():
            if needs.get(b, (None,))[0] is not r:
                needs[b] = r, (SmallestGpu(oracle.traces[b], r["memory"], oracle.resume(b)) if r["status"] == "ok"
                               else None)
        return {0: persistent} | {b // unit: needs[b][1] for b in oracle.records if b % unit == 0}

    if oracle.line is not False:
        # a step beyond the largest size's answer (twice the guess of a line through batch 0
        # and --batch-size), so that the batches the search asks about lie between steps
        # run: on a confirmed line (`bench.measure.trace_line`) they are computed, not run
        k0 = batch_size // unit
        rise = int(known()[k0]) - persistent
        guess = (int(max(memory_gb) * GiB) - persistent) // rise * k0 if rise > 0 else most
        oracle.need(unit * min(most, max(2 * guess, 2 * k0)))
    rows = []
    for gb in sorted(memory_gb):
        size = int(gb * GiB)
        guess = capacity.guess_largest(lambda k: oracle.need(k * unit), known, size, most, probes=())
        k = capacity.largest_fitting(lambda k: oracle.fits(k * unit, size), guess, most)
        fits = oracle.fits(batch_size, size)
        if oracle.error:
            return failed(oracle.error)
        largest = oracle.records.get(k * unit)
        rows.append({**base, "memory_gb": gb, "n_params": record["n_params"], "fits": fits,
                     "predicted_gpu_bytes": memory["predicted_gpu_bytes"],
                     **{f"{c}_bytes": memory[f"{c}_bytes"] for c in CATEGORIES},
                     "peak_bytes": memory["peak_bytes"], "tier": memory["tier"],
                     # inside `other`: what sharding adds at the peak (gathered parameters, buffers)
                     "sharding_bytes": record.get("sharding", {}).get("bytes", 0),
                     # what offloading keeps in host memory at --batch-size (the warm-up,
                     # at a smaller batch, keeps no more): not a limit of the search
                     "host_peak_bytes": memory.get("host_peak_bytes", 0),
                     "largest_batch": k * unit, "at_max_batch": k == most,
                     "predicted_gpu_bytes_at_largest":
                         largest["memory"]["predicted_gpu_bytes"] if k and largest else None})
    steps = sorted(b for b, r in oracle.records.items() if not r.get("line") and not r.get("depth"))
    shallow = sorted(b for b, r in oracle.records.items() if r.get("depth"))
    computed = sorted(b for b, r in oracle.records.items() if r.get("line"))
    print(f"{label} " + "; ".join(f"{r['memory_gb']:g} GiB: {'fits' if r['fits'] else 'does not fit'}"
                                  f", largest batch {r['largest_batch']}" for r in rows)
          + " (" + "; ".join(part for part in (
              f"{len(steps)} steps run: batch {', '.join(map(str, steps))}" if steps else "",
              f"read from shallow copies: batch {', '.join(map(str, shallow))}" if shallow else "",
              f"from their line: batch {', '.join(map(str, computed))}" if computed else "",
              f"{time.perf_counter() - started:.1f} s") if part) + ")", file=sys.stderr, flush=True)
    return rows


def error_rows(base: dict, memory_gb: list[float], message: str) -> list[dict]:
    """A method's rows when its question has no answer: one per memory size, saying why."""
    return [{**base, "memory_gb": gb, "status": "error", "message": message} for gb in sorted(memory_gb)]


def smallest_gpu(trace: list, memory: dict, resolution: int | None = None, prefix=None) -> int:
    """About the smallest GPU on which `trace` replays without running out of memory:
    between the allocated peak and the reserve of an unlimited replay (the allocator frees
    its cache and retries before it fails), found by bisection on replays, to `resolution`
    bytes (default: a sixteenth of that range, at least 64 MiB; four or five replays). What
    the largest-batch search steers by; each answer it gives is still a replay at the memory
    size itself. `prefix`: events the trace may start with, replayed already
    (`allocator.Prefix`)."""
    from bench.measure import allocator

    lo = memory["predicted_allocated_peak_bytes"] + allocator.CUDA_CONTEXT_BYTES
    hi = memory["predicted_gpu_bytes"]
    resolution = resolution or max(2**26, (hi - lo) // 16)
    replays = allocator.Rising(trace, prefix)  # each size above the last that did not fit
    if lo >= hi or replays.fits_on_gpu(lo):
        return lo
    while hi - lo > resolution:  # lo does not fit, hi does
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if replays.fits_on_gpu(mid) else (mid, hi)
    return hi


class SmallestGpu:
    """`smallest_gpu(trace, memory)` as the search reads it: bytes compared with memory sizes
    (and with others like them) and interpolated between. They lie between the allocated peak
    (plus the CUDA context) and the unlimited replay's need, so a comparison those bounds
    settle needs no replay; the bisection runs once, where one does not (or the number itself
    is read)."""

    def __init__(self, trace: list, memory: dict, prefix=None):
        from bench.measure import allocator

        self.trace, self.memory, self.prefix = trace, memory, prefix
        self.lo = memory["predicted_allocated_peak_bytes"] + allocator.CUDA_CONTEXT_BYTES
        self.hi = max(self.lo, memory["predicted_gpu_bytes"])
        self._bytes: int | None = None

    def __int__(self) -> int:
        if self._bytes is None:
            self._bytes = smallest_gpu(self.trace, self.memory, prefix=self.prefix)
        return self._bytes

    def __float__(self) -> float:
        return float(int(self))

    def __le__(self, other) -> bool:
        if isinstance(other, SmallestGpu):
            return int(self) <= int(other)
        return self.hi <= other or (self.lo <= other and int(self) <= other)

    def __ge__(self, other) -> bool:
        if isinstance(other, SmallestGpu):
            return int(self) >= int(other)
        return self.lo >= other or (self.hi >= other and int(self) >= other)

    def __gt__(self, other) -> bool:
        return not self <= other

    def __lt__(self, other) -> bool:
        return not self >= other


def run(model: str, methods: list[str], memory_gb: list[float], batch_size: int, seq_len: int,
        dtype: str = FIT_DEFAULTS["dtype"], max_batch: int = FIT_DEFAULTS["max_batch"],
        seed: int = FIT_DEFAULTS["seed"],
        attn_implementation: str = FIT_DEFAULTS["attn_implementation"],
        precision: str = FIT_DEFAULTS["precision"], jobs: int = 1, gpus: list[int] = FIT_DEFAULTS["gpus"],
        sharding: list[str] = FIT_DEFAULTS["sharding"]) -> list[dict]:
    """Every method's rows (see `answer`) for every layout (`layouts`: GPU count and
    scheme), in the order of `methods`, `jobs` methods at once (worker processes; 1: here,
    one after another); FitError when the model cannot be built or the dtype and precision
    cannot go together."""
    from bench.measure.step import precision_error

    problem = precision_error(dtype, precision)
    if problem:
        raise FitError(problem)
    check_model(model, seq_len, attn_implementation)
    return answer_all(tasks(model, methods, memory_gb, batch_size, seq_len, dtype, max_batch, seed,
                            attn_implementation, precision, layouts(gpus, sharding)), jobs)


def layouts(gpus: list[int], sharding: list[str]) -> list[tuple[int, str]]:
    """(GPU count, scheme) pairs to answer: one GPU alone (no scheme), every scheme at each
    larger count."""
    return list(dict.fromkeys((n, "none") if n == 1 else (n, scheme)
                              for n in gpus for scheme in sharding))


def tasks(model: str, methods: list[str], memory_gb: list[float], batch_size: int, seq_len: int,
          dtype: str, max_batch: int, seed: int, attn_implementation: str, precision: str,
          layouts: list[tuple[int, str]] = ((1, "none"),)) -> list[dict]:
    """One job description per method: `answer`'s arguments and its `layouts`, what a
    worker receives (a method's layouts in one worker: ZeRO's share a timeline per batch)."""
    return [dict(model=model, method=method, memory_gb=list(memory_gb), batch_size=batch_size,
                 seq_len=seq_len, dtype=dtype, max_batch=max_batch, seed=seed,
                 attn_implementation=attn_implementation, precision=precision,
                 label=f"[{i}/{len(methods)}] {method}", layouts=[list(x) for x in layouts])
            for i, method in enumerate(methods, 1)]


def answer_layouts(task: dict) -> list[dict]:
    """A task's rows: `answer` at each of its layouts."""
    task = dict(task)
    out = []
    for world_size, sharding in task.pop("layouts"):
        where = "" if world_size == 1 else f" [{sharding} x{world_size}]"
        out += answer(**{**task, "label": f"{task['label']}{where}:"}, world_size=world_size, sharding=sharding)
    return out


def answer_all(todo: list[dict], jobs: int = 1) -> list[dict]:
    """Every task's rows (`answer_layouts(task)`), in the order of `todo`: here one after
    another with `jobs` 1 (or one task), else in min(jobs, tasks) worker processes, whose
    stderr lines are written to this process's stderr as they come. The workers start the
    methods that plan each batch shape first (ROAM): their searches are read from no shallow
    copy and no line, the longest by far, and started last they would run on alone."""
    jobs = max(1, min(jobs, len(todo)))
    if jobs == 1:
        return [row for task in todo for row in answer_layouts(task)]
    from concurrent.futures import ProcessPoolExecutor

    from bench import workers

    context = workers.context()  # forks of a fresh interpreter that imported torch once
    lines = context.Queue()
    relay = threading.Thread(target=_relay, args=(lines, sys.stderr), daemon=True)
    relay.start()
    try:
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_start,
                                 initargs=(lines,)) as pool:
            futures = {i: pool.submit(_answer_task, todo[i])  # submitted in this order
                       for i in sorted(range(len(todo)), key=lambda i: not _plans_per_shape(todo[i]["method"]))}
            rows = []
            for i, task in enumerate(todo):
                try:
                    rows += futures[i].result()
                except Exception as e:  # noqa: BLE001 - a worker that died: its method's rows say so
                    base = {k: task[k] for k in ("model", "method", "batch_size", "seq_len", "dtype",
                                                 "precision")}
                    for world_size, sharding in task["layouts"]:
                        rows += error_rows({**base, "world_size": world_size, "sharding": sharding,
                                            "n_params": None, "fits": False, "predicted_gpu_bytes": None,
                                            "largest_batch": None}, task["memory_gb"], _line(e))
    finally:
        lines.put(None)  # after every worker has exited, so after all their lines
        relay.join()
    return rows


def _plans_per_shape(method: str) -> bool:
    from bench.method import load

    try:
        return load(method).plans_per_shape
    except Exception:  # noqa: BLE001 - a method that cannot load is its worker's row to say
        return False


def _relay(lines, stream) -> None:
    """Write the workers' stderr lines to `stream` until a None comes."""
    while (line := lines.get()) is not None:
        stream.write(line)
        stream.flush()


class _LineWriter:
    """A worker's stderr: each whole line goes to the parent's relay queue."""

    def __init__(self, lines):
        self.lines, self.buffer = lines, ""

    def write(self, text: str) -> int:
        self.buffer += text
        if "\n" in self.buffer:
            done, _, self.buffer = self.buffer.rpartition("\n")
            self.lines.put(done + "\n")
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _worker_start(lines) -> None:
    sys.stderr = _LineWriter(lines)
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; the other cores are the other workers'
    # Python's cyclic garbage collector: what the imports made is never garbage (frozen, not
    # scanned again), and a simulated step makes objects by the million (fake tensors, graph
    # nodes, hooks), so the young ones are scanned every 10,000 allocations, not every 700
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _answer_task(task: dict) -> list[dict]:
    rows = answer_layouts(task)
    sys.stderr.flush()
    return rows


def table(rows: list[dict]) -> str:
    """The rows as text: one table per memory size; sizes in GiB (MiB for a model whose
    peaks are all under 1 GiB)."""
    from bench.measure.allocator import CUDA_CONTEXT_BYTES
    from bench.report.tables import method_label

    if not rows:
        return ""
    label = {id(r): method_label(r["method"], r.get("world_size", 1), r.get("sharding", "none")) for r in rows}
    ok = [r for r in rows if r["status"] == "ok"]
    first = (ok or rows)[0]
    name, scale = ("GiB", GiB) if max((r["peak_bytes"] for r in ok), default=GiB) >= GiB else ("MiB", 2**20)
    size = lambda n: "-" if n is None else f"{n / scale:.1f}"  # noqa: E731
    n = first["n_params"]
    lines = [f"{first['model']}" + (f": {n / 1e9:.2f} B parameters" if n and n >= 1e9 else
                                     f": {n / 1e6:.2f} M parameters" if n else ""),
             f"training step at batch {first['batch_size']} x {first['seq_len']} tokens, "
             f"{precision_text(first)}, simulated on fake tensors; GPU need = the caching-allocator "
             f"model's peak reserve + {size(CUDA_CONTEXT_BYTES)} {name} CUDA context; sizes in {name}"]
    hosted = any(r.get("host_peak_bytes") for r in ok)  # a host column where a method offloads
    head = ("method", "param", "grad", "optim", "activ", "other", "peak", "GPU need") + \
        (("host",) if hosted else ()) + ("fits", "largest batch")
    width = max([len(head[0])] + [len(name) for name in label.values()])
    fmt = f"{{:<{width}}}" + "".join(f"  {{:>{max(6, len(h))}}}" for h in head[1:-1]) + "  {}"
    starred = False
    for gb in sorted({r["memory_gb"] for r in rows}):
        lines += ["", f"GPU with {gb:g} GiB", fmt.format(*head)]
        for r in (r for r in rows if r["memory_gb"] == gb):
            if r["status"] != "ok":
                lines.append(f"{label[id(r)]:<{width}}  error: {r['message']}")
                continue
            star = r["fits"] and r["predicted_gpu_bytes"] > gb * GiB
            starred |= star
            largest = f"{r['largest_batch']}{'+' if r.get('at_max_batch') else ''}"
            host = (size(r.get("host_peak_bytes") or 0),) if hosted else ()
            lines.append(fmt.format(label[id(r)], *(size(r[f"{c}_bytes"]) for c in CATEGORIES),
                                    size(r["peak_bytes"]), size(r["predicted_gpu_bytes"]), *host,
                                    ("yes*" if star else "yes") if r["fits"] else "no", largest))
    if any(r.get("world_size", 1) > 1 for r in ok):
        lines += ["", "[scheme xN]: one of N GPUs, each training on the batch (per-GPU batch; the global batch is "
                      "N times it): fsdp = FSDP2 simulated, rank 0 (it holds the most); zero1-3 = DeepSpeed ZeRO "
                      "modelled, the largest rank; ddp = replicas, one GPU's memory. What sharding adds (gathered "
                      "parameters, communication buffers) is inside other (docs/sharding.md)"]
    if hosted:
        lines += ["", "host: host memory the method keeps (offloading), at the step's batch; GPU memory "
                      "sizes do not limit it"]
    if starred:
        lines += ["", "yes*: fits although the need is above the size: the allocator frees its "
                      "cached blocks and retries before it runs out of memory"]
    if any(r.get("at_max_batch") for r in rows):
        lines += ["+: the search's largest batch (--max-batch) fits"]
    return "\n".join(lines)


def precision_text(row: dict) -> str:
    """What the table says of a row's precision: `bfloat16`, or `mixed precision (float32
    parameters, gradients and optimizer state; float16 compute under autocast)`; float16
    adds its loss scaling."""
    dtype, precision = row["dtype"], row.get("precision", "pure")
    text = (dtype if precision == "pure" else
            f"mixed precision (float32 parameters, gradients and optimizer state; {dtype} "
            f"compute under autocast)")
    if dtype == "float16":
        text += " with dynamic loss scaling where the method's step scales (loss_scaling)"
    return text


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)  # each number's bounds: an argparse error naming the flag, exit 2
    if max(args.gpus) > PROPERTIES["world_size"]["maximum"]:
        p.error(f"argument --gpus: at most {PROPERTIES['world_size']['maximum']} GPUs, not {max(args.gpus)}")
    if args.max_batch < args.batch_size:
        p.error(f"argument --max-batch: must be at least --batch-size ({args.batch_size}), "
                f"not {args.max_batch}")
    from bench.measure.step import precision_error

    problem = precision_error(args.dtype, args.precision)
    if problem:
        p.error(f"argument --precision: {problem}")
    from bench.method import available, member_names

    methods = args.methods or simulable_methods()
    unknown = [m for m in methods for name in member_names(m) if name not in available()]
    if unknown:
        print(f"membench fit: error: unknown method {unknown[0]!r}; available: "
              f"{', '.join(available())}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        rows = run(args.model, methods, args.memory_gb, args.batch_size, args.seq_len,
                   args.dtype, args.max_batch, args.seed, args.attn_implementation, args.precision,
                   args.jobs, args.gpus, args.sharding)
    except FitError as e:
        print(f"membench fit: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        reasons = list(dict.fromkeys(r["message"] for r in rows))
        print(f"membench fit: error: no method's step runs for {args.model}: "
              + (reasons[0] if len(reasons) == 1 else " | ".join(reasons)), file=sys.stderr)
        return 2
    print(table(rows))
    print(f"membench fit: {len(methods)} methods, {len(args.memory_gb)} memory sizes in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
