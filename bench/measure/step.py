"""What every kind of job does first: build the model (on its device, in its dtype, or on
fake tensors), the data stream, and check what a job asks for; plus what turns a failed
step into a result (the one-line message, divergence) and what a simulated step predicts
for a CUDA GPU (the allocator replay)."""
from __future__ import annotations

import contextlib
import gc
import math
import os

import torch

from bench import data, models
from bench.errors import first_line
from bench.measure import allocator
from bench.measure.tracker import CapacityExceeded
from bench.job import Job
from bench.method import LossScaler, Method, Precision, use_precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# the compute dtypes autocast takes (a mixed-precision job's `dtype`)
AUTOCAST_DTYPES = ("bfloat16", "float16")


def precision_error(dtype: str, precision: str) -> str | None:
    """Why a job's `dtype` and `precision` cannot go together, or None: mixed precision
    computes in a low-precision dtype under autocast over float32 parameters, so its
    `dtype` must be bfloat16 or float16. Checked before any job (the suite check,
    `membench run`, `membench fit`) and again by `setup`."""
    if precision == "mixed" and dtype not in AUTOCAST_DTYPES:
        return (f"precision: mixed needs dtype bfloat16 or float16 (the compute dtype under "
                f"autocast; the parameters are float32), not dtype: {dtype}")
    return None


def param_dtype(job: Job) -> torch.dtype:
    """The dtype the model's parameters are built in: float32 (the master copy) under
    mixed precision, else the job's dtype."""
    return torch.float32 if job.precision == "mixed" else DTYPES[job.dtype]


def job_precision(job: Job) -> Precision:
    """The job's Precision (bench.method): a fresh float16 loss scaler for float16."""
    return Precision(dtype=DTYPES[job.dtype], mixed=job.precision == "mixed",
                     device_type=torch.device(job.device).type,
                     scaler=LossScaler() if job.dtype == "float16" else None)


def loss_scaler_record(model, method: Method) -> dict:
    """What a float16 result states of its loss scaling: the scaler's final scale and the
    updates it skipped, or that the method's step runs unscaled (`loss_scaling = False`);
    nothing for other dtypes."""
    from bench.method import precision_of

    scaler = precision_of(model).scaler
    if scaler is None:
        return {}
    if not method.loss_scaling:
        return {"loss_scaler": {"scaling": "none (the method's step runs float16 unscaled)"}}
    return {"loss_scaler": {"scaling": "dynamic", **scaler.state()}}


class Diverged(RuntimeError):
    """The loss became NaN or infinite; `partial` keeps what was measured before."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial or {}


class TimedOut(BaseException):
    """The job ran past its time limit (`Job.time_limit`); `partial` keeps what was measured
    before. Not an Exception (as KeyboardInterrupt is not), so no handler that makes a
    method's failure a row (a panel's side, a capacity probe) takes it for one."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial or {}


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimedOut in this (the main) thread once `seconds` have passed, between two
    Python operations (a call stuck inside C code is ended from outside: `membench many`)."""
    import signal

    def expire(signum, frame):
        raise TimedOut(f"time limit of {seconds:g} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_message(e: Exception, simulated: bool) -> str:
    """The one-line message of a failed job; on fake tensors, says when the failure is
    that the step needs a tensor's value (data-dependent ops), which fake tensors lack."""
    message = f"{type(e).__name__}: {first_line(e)}"
    if simulated:
        from torch._subclasses import fake_tensor

        limits = (fake_tensor.DataDependentOutputException,
                  fake_tensor.DynamicOutputShapeException,
                  fake_tensor.UnsupportedOperatorException)
        if isinstance(e, limits) or "data-dependent" in str(e).lower():
            message = ("cannot run on fake tensors (the simulated tier): the step needs a "
                       f"tensor's value; measure it on real tensors instead ({message})")
    return message


def fake_mode():
    """A fresh fake mode for a simulated job (`bench.measure.fake`)."""
    from bench.measure.fake import FakeMode

    return FakeMode()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


LEFT_OK_BYTES = 16 * 2**20  # allocated bytes a measured job may start with (see setup)


def cuda_left(device: str) -> int:
    """Bytes still allocated on CUDA `device` once this process's garbage, cuBLAS's
    workspaces (kept in the caching allocator from the first matmul on) and the cache are
    freed."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def check_batch(job: Job, method: Method) -> None:
    if job.batch_size % method.hp["micro_batches"]:
        raise ValueError(f"batch size {job.batch_size} is not divisible by micro_batches="
                         f"{method.hp['micro_batches']} of {method.name}")


def setup(job: Job, method: Method, fake=None):
    models.config_of(job.model)  # a clear error for an unknown name
    check_batch(job, method)
    problem = precision_error(job.dtype, job.precision)
    if problem:
        raise ValueError(problem)
    if job.seq_len > models.max_positions(job.model):
        raise ValueError(f"seq_len {job.seq_len} exceeds {job.model}'s {models.max_positions(job.model)} positions")
    if job.device.startswith("cuda"):
        # a capacity search runs several jobs in one process: start each from an empty
        # cache, under its own cap (or none)
        left = cuda_left(job.device)
        # the measured tier reads the allocator's peak: it must start from (almost) nothing.
        # A few bytes stay after a first step, once per process (e.g. 512 B on an H100 after
        # a LLaMA step; not Python tensors): a capacity search's later probes count them.
        # A throughput job's second side is built beside the first.
        if left > LEFT_OK_BYTES and job.kind != "throughput":
            raise RuntimeError(f"{left:,} bytes are still allocated on {job.device} by an earlier "
                               f"run in this process (something kept its tensors alive); a "
                               f"measured job needs a clean process")
        index = torch.device(job.device).index
        index = torch.cuda.current_device() if index is None else index  # "cuda" means the current one
        total = torch.cuda.get_device_properties(index).total_memory
        cap = job.capacity_gb * 2**30 / total if job.capacity_gb else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap), index)
    torch.manual_seed(job.seed)
    # Built directly in its dtype and on its device: no copy, and it works on fake tensors,
    # which hold no values: there, the random init (most of a 7B model's build) is skipped
    with fake or contextlib.nullcontext(), torch.device(job.device), default_dtype(param_dtype(job)), \
            (_no_init() if fake is not None else contextlib.nullcontext()):
        model = models.build(job.model, job.attn_implementation, job.dropout)
    if job.init and fake is None:  # fake tensors hold no values: nothing to load
        load_weights(model, job.init)
    model = method.transform_model(model)
    use_precision(model, job_precision(job))  # autocast (mixed) and the float16 loss scaler
    model.train()
    task = data.make_task(job.task)
    objective = models.OBJECTIVE[models.family(job.model)]
    stream = data.Stream(task, objective, models.vocab_size(job.model), job.batch_size, job.seq_len, job.seed)
    return model, stream


@contextlib.contextmanager
def _no_init():
    """The weights' random init skipped: torch.nn.init's functions, where torch's modules and
    transformers' `_init_weights` call them, do nothing inside (what transformers'
    `no_init_weights` patches, but not `init_weights` itself, which also ties the output head
    to the embedding: the model's structure is the same)."""
    import sys

    from transformers import initialization

    def nothing(tensor, *args, **kwargs):
        return tensor

    modules = [sys.modules[m] for m in initialization.TORCH_MODULES_TO_PATCH if m in sys.modules]
    saved = [(m, name, getattr(m, name)) for m in modules + [initialization]
             for name in initialization.TORCH_INIT_FUNCTIONS if hasattr(m, name)]
    try:
        for module, name, _ in saved:
            setattr(module, name, nothing)
        yield
    finally:
        for module, name, func in saved:
            setattr(module, name, func)


def load_weights(model: torch.nn.Module, path: str) -> None:
    """Start `model` from the weights a pre-training run saved (`save_weights`), cast to
    the model's dtype; a missing file or another model's weights are a clear error."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"init {path}: no such file (the pre-training run that writes it has not run)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"init {path} holds another model's weights: {first_line(e)}") from None


def next_batch(stream: data.Stream, device: str) -> dict:
    return {k: v.to(device) for k, v in stream.next().items()}


def batch_feeder(stream: data.Stream, device: str, fake, tracker, steps: int = 2):
    """A memory measurement's batches: `steps` drawn now (real tokens, before any tracking),
    then `take()` hands out the next, made fake on fake tensors and registered with
    `tracker` as `other`: each step's batch exists from its step on, as from a data loader."""
    raw = [next_batch(stream, device) for _ in range(steps)]

    def take() -> dict:
        batch = raw.pop(0)
        if fake is not None:
            batch = {k: fake.from_tensor(v) for k, v in batch.items()}
        tracker.register(batch.values(), "other")
        return batch

    return take


def memory_steps(method: Method, model, tracker, take_batch, on_optimizer=None, check=None, after_warm_up=None,
                 measured=None):
    """A memory job's two steps, inside the caller's fake mode (if any) and `tracker`: the
    optimizer made, the warm-up step (it creates the optimizer state, as a training run's
    first step does), then the measured step on the next batch (`take_batch`,
    `batch_feeder`) from a reset peak; the optimizer's state labelled after each. Every
    memory job runs these (`kinds._memory`, `sharded._memory`), and so does every batch of
    a simulated search (`capacity._Simulation`) and every ZeRO timeline
    (`zero.labelled_run`): a search's batch is its memory job by construction.
    `on_optimizer(optimizer)`: before the warm-up (step hooks); `check(loss, 0)`: the warm-up's
    loss (a real run's divergence); `after_warm_up()`: once the warm-up is done (its state
    labelled, its loss let go), before the measured step's batch;
    `measured`: a context manager entered around the measured step alone, after its batch
    and the peak's reset (its cost, its CUDA peak). Returns the optimizer and the measured
    step's loss."""
    optimizer = method.make_optimizer(model)
    if on_optimizer is not None:
        on_optimizer(optimizer)
    loss = method.train_step(model, optimizer, take_batch())
    tracker.label(method.state_tensors(optimizer), "optimizer")
    if check is not None:
        check(loss, 0)
    del loss  # the measured step starts from the persistent state and its own batch
    if after_warm_up is not None:
        after_warm_up()
    batch = take_batch()
    tracker.reset_peak()
    with measured or contextlib.nullcontext():
        loss = method.train_step(model, optimizer, batch)
    tracker.label(method.state_tensors(optimizer), "optimizer")
    return optimizer, loss


def checked(loss: torch.Tensor, step: int) -> float:
    value = float(loss)
    if not math.isfinite(value):
        raise Diverged(f"loss is {value} at step {step}")
    return value


def predict_gpu(events: list, capacity_gb: float | None, prefix: allocator.Prefix | None = None) -> dict:
    """What a CUDA GPU would need for this simulated run: the allocation trace replayed
    through the caching-allocator model, plus the CUDA context; over `capacity_gb`, the
    run is an (predicted) out-of-memory. `prefix`: events the trace may start with, replayed
    already (`allocator.Prefix`)."""
    free_run = allocator.replay(events, None, prefix)
    predicted = gpu_need(free_run)
    if capacity_gb:
        capped = allocator.replay_on_gpu(events, int(capacity_gb * 2**30), prefix)
        if not capped.fits:
            raise CapacityExceeded(
                f"predicted out of memory on a {capacity_gb:g} GiB GPU: a {capped.failed_request_bytes:,}"
                f"-byte allocation does not fit (allocator model, {allocator.CUDA_CONTEXT_BYTES:,} "
                f"bytes of CUDA context)")
        predicted["alloc_retries"] = capped.alloc_retries
    return predicted


def gpu_need(free_run: allocator.Replay) -> dict:
    """`predict_gpu`'s fields from a trace's unlimited replay (its `alloc_retries`: that
    replay's, as `predict_gpu` without a capacity gives them)."""
    return {"predicted_allocated_peak_bytes": free_run.allocated_peak_bytes,
            "reserved_peak_bytes": free_run.reserved_peak_bytes,
            "context_bytes": allocator.CUDA_CONTEXT_BYTES,
            "predicted_gpu_bytes": free_run.reserved_peak_bytes + allocator.CUDA_CONTEXT_BYTES,
            "alloc_retries": free_run.alloc_retries}


