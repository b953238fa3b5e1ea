"""Estimated step time on named GPUs, from a step's exact cost: the `estimated` tier of
throughput. Uncalibrated until fitted to measured GPU rows; every number it gives is
labelled so.

The model (a roofline per operator, summed): an operator with F FLOPs in dtype d that
moves B bytes takes

    max(F / peak_d, B / bandwidth) + launch

seconds on a GPU with those spec-sheet figures, and a step is the sum over its operators
(`bench.measure.cost.StepCost.per_op`: one kernel per aten operator, run one after
another, as in eager mode). peak_d is the dense (not 2:4 sparse) tensor-core rate for
bf16 / fp16 matmuls, the plain FP32 rate for float32 (PyTorch's default: TF32 off for
matmuls; `tf32=True` uses the TF32 tensor-core rate), FP64 for float64. `launch` is a
per-operator overhead (kernel launch and eager dispatch), a guess of 5 microseconds until
calibrated.

Calibration: with measured step times of the same jobs on a GPU, `fit_efficiency` finds by
non-negative least squares the factors of

    measured = C / e_compute + M / e_memory + N x launch_s

where C is the summed time of the operators the roofline calls compute-bound (at peak), M
that of the bandwidth-bound ones, N the operator count; e_compute and e_memory are the
fractions of the spec-sheet rates reached, launch_s the per-operator overhead.
`estimate(..., efficiency=fit)` then gives C / e_compute + M / e_memory + N x launch_s.

Host transfers (offloading; `transfer_bytes` of a memory result, both directions): they
take `transfer_bytes / host_link` seconds (`transfer_seconds`, estimated, uncalibrated),
each byte at one direction's rate of the GPU's host link (`GPU.host_link_gbs`; the two
directions are not assumed to run at once). How they meet the compute is bounded by two
assumptions, both given (`estimate_row`): no overlap, the step takes compute + transfer
(`_step_time_serial_s`; copies on the compute stream, as `bench.hooks` issues them); full
overlap, max(compute, transfer) (`_step_time_overlap_s`; torchtune's and torchao's side
streams at best). An offloaded optimizer's host step is counted as GPU operators by the
cost (its time on the host CPU is not modelled).

Collectives (data parallelism; a memory result's `sharding.collectives.wire_bytes`, the bytes
each rank sends per step under a ring algorithm: `bench.measure.collectives`): they take
`wire_bytes / link` seconds (`collective_seconds`, estimated, uncalibrated), each byte at one
direction's rate (a ring sends and receives at once, as much each way). Inside one node
(world_size <= `GPUS_PER_NODE`, 8) the link is the GPU's NVLink (`GPU.peer_link_gbs`, per
direction; a PCIe card: its PCIe link); across nodes (world_size > 8) a ring crosses the
network, whose per-GPU bandwidth bounds it: min(NVLink, `INTER_NODE_GBS`), an assumption
(400 Gb/s InfiniBand NDR, one adapter per GPU, as in a DGX/HGX H100: 50 GB/s each way).
Left out: each collective's latency (a fixed cost per call, per ring step), NCCL's
achieved fraction of the link (its bus bandwidth is below the spec sheet's), trees, NVLink
SHARP and in-network reduction, and the overlap of collectives with compute (FSDP2 and
DeepSpeed prefetch and reduce on streams of their own): compare with the step's compute
estimate as for host transfers, added (no overlap) or the larger of the two (full overlap).

Known blind spots (say them wherever an estimate is shown): no overlap of operators (CUDA
streams, NCCL), no fusion (torch.compile, fused optimizers count as their aten ops, a
foreach op as one launch), the same efficiency for every matmul shape (small matmuls reach
far less than peak), attention kernels counted by their FLOPs only, host-side stalls (a
`.item()`, data loading, the Python of a method's own step) not seen at all, CPU-only
kernels of the CPU run standing for the CUDA ones (e.g. the CPU's fused attention for
flash attention), and the bytes rule of `bench.measure.cost` (tensor sizes, no cache
reuse).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent.parent / "results" / "reference" / "gpu_efficiency.json"
LAUNCH_S = 5e-6  # per-operator overhead until calibrated (a guess, not a measurement)
DEFAULT_GPU = "h100-sxm-80gb"
LABEL = "estimated, uncalibrated"
GPUS_PER_NODE = 8  # GPUs one node's NVLink joins (an HGX/DGX board); a larger world spans nodes
INTER_NODE_GBS = 50  # assumed: 400 Gb/s InfiniBand NDR per GPU = 50 GB/s per direction


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    tflops: dict  # dtype class -> dense peak TFLOP/s ("bf16", "fp16", "tf32", "fp32", "fp64")
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes per second)
    source: str
    host_link_gbs: float  # host <-> GPU link, GB/s per direction
    peer_link_gbs: float  # GPU <-> GPU inside a node (NVLink; a PCIe card: PCIe), GB/s per direction
    notes: str = ""
    launch_s: float = LAUNCH_S


# Spec-sheet figures, dense (the sheets' "with sparsity" figures are twice these).
GPUS = {
    "h100-sxm-80gb": GPU(
        "NVIDIA H100 SXM 80GB", 80,
        {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67, "fp64": 34}, 3350,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16/FP16 tensor core "
        "1,979 TFLOPS and TF32 989 TFLOPS with sparsity, halved for dense; FP32 67, "
        "FP64 34 TFLOPS; HBM3 3.35 TB/s; PCIe Gen5 128 GB/s (both directions: 64 GB/s each, x16); "
        "NVLink 900 GB/s (both directions: 450 GB/s each)",
        host_link_gbs=64, peer_link_gbs=450),
    "a100-sxm-80gb": GPU(
        "NVIDIA A100 SXM 80GB", 80,
        {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5, "fp64": 9.7}, 2039,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): BF16/FP16 tensor core "
        "312 TFLOPS, TF32 156 TFLOPS (dense; 624 / 312 with sparsity), FP32 19.5, "
        "FP64 9.7 TFLOPS; HBM2e 2,039 GB/s; PCIe Gen4 64 GB/s (both directions: 32 GB/s each, x16); "
        "NVLink 600 GB/s (both directions: 300 GB/s each)",
        host_link_gbs=32, peer_link_gbs=300),
    "rtx4090-24gb": GPU(
        "NVIDIA GeForce RTX 4090 24GB", 24,
        {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6, "fp64": 1.29}, 1008,
        "NVIDIA Ada Lovelace GPU architecture whitepaper, appendix table for the RTX 4090: "
        "FP16/BF16 tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 sparse), TF32 "
        "82.6 dense, FP32 82.6 TFLOPS (FP64 1/64 of it); GDDR6X 1,008 GB/s; PCIe Gen4 x16 (PCI-SIG: "
        "16 GT/s a lane, about 32 GB/s per direction); no NVLink: GPU to GPU over PCIe, 32 GB/s per direction "
        "(assumed; GeForce has no peer-to-peer, so NCCL goes through host memory, slower)",
        host_link_gbs=32, peer_link_gbs=32,
        notes="GeForce: half-rate FP16/BF16 tensor math with the FP32 accumulate PyTorch uses"),
    "v100-sxm2-16gb": GPU(
        "NVIDIA V100 SXM2 16GB", 16,
        {"fp16": 125, "fp32": 15.7, "fp64": 7.8}, 900,
        "NVIDIA Tesla V100 datasheet (V100 SXM2 column; dense, Volta has no sparsity): tensor performance 125 TFLOPS "
        "(FP16), single precision 15.7, double precision 7.8 TFLOPS; HBM2 900 GB/s; PCIe Gen3 32 GB/s (both "
        "directions: 16 GB/s each); NVLink 300 GB/s (both directions: 150 GB/s each)",
        host_link_gbs=16, peer_link_gbs=150,
        notes="no BF16 or TF32 tensor cores: bf16 and tf32 matmuls at the FP32 rate (assumed)"),
}

_DTYPE_CLASS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def peak_flops(gpu: GPU, dtype: str, tf32: bool = False) -> float:
    """FLOP/s of a matmul-class operator in `dtype` ("bfloat16", "float32", ...)."""
    cls = _DTYPE_CLASS.get(dtype, "fp32")
    if cls == "fp32" and tf32:
        cls = "tf32"
    return gpu.tflops.get(cls, gpu.tflops["fp32"]) * 1e12


def components(per_op, gpu: GPU | str, tf32: bool = False) -> dict:
    """The roofline's parts of a step: `compute_s` (the compute-bound operators' FLOPs at
    peak), `memory_s` (the bandwidth-bound ones' bytes at full bandwidth), `launches`
    (operators). `per_op`: rows [phase, op, dtype, flops, bytes, calls] (StepCost)."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    compute = memory = launches = 0.0
    bandwidth = gpu.bandwidth_gbs * 1e9
    for _phase, _op, dtype, flops, moved, calls in per_op:
        c = flops / peak_flops(gpu, dtype, tf32) if flops else 0.0
        m = moved / bandwidth
        if c > m:
            compute += c * calls
        else:
            memory += m * calls
        launches += calls
    return {"compute_s": compute, "memory_s": memory, "launches": launches}


def estimate(per_op, gpu: GPU | str, efficiency: dict | None = None, tf32: bool = False) -> float:
    """Seconds per step on `gpu`: the sum over operators of max(F / peak, B / bandwidth)
    plus the launch overhead (uncalibrated), or with `efficiency` (`fit_efficiency`'s
    `compute`, `memory`, `launch_s`) the calibrated model (module docstring)."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    eff = {"compute": 1.0, "memory": 1.0, "launch_s": gpu.launch_s, **(efficiency or {})}
    parts = components(per_op, gpu, tf32)
    return (parts["compute_s"] / eff["compute"] + parts["memory_s"] / eff["memory"]
            + parts["launches"] * eff["launch_s"])


def fit_efficiency(samples, gpu: GPU | str, tf32: bool = False) -> dict:
    """Efficiency factors of `gpu` from measured steps: `samples` is a list of (per_op,
    measured seconds per step). Non-negative least squares of measured = a C + b M + c N
    (every subset of the three terms solved exactly, the best non-negative one kept);
    e_compute = 1 / a, e_memory = 1 / b (None where a term was fitted as 0: not
    identifiable from these samples), launch_s = c. Also the fit's residuals."""
    import numpy as np

    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    parts = [components(per_op, gpu, tf32) for per_op, _ in samples]
    x = np.array([[p["compute_s"], p["memory_s"], p["launches"]] for p in parts], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # columns of like size
    best = None
    for k in (3, 2, 1):
        for cols in itertools.combinations(range(3), k):
            sol, *_ = np.linalg.lstsq(x[:, cols] / scale[list(cols)], y, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(3)
            coef[list(cols)] = sol / scale[list(cols)]
            err = float(np.sum((x @ coef - y) ** 2))
            if best is None or err < best[1] * (1 - 1e-12):
                best = (coef, err)
    if best is None:
        raise ValueError("no non-negative fit")
    (a, b, c), err = best
    predicted = x @ best[0]
    return {"gpu": gpu.name, "compute": 1 / a if a > 0 else None,
            "memory": 1 / b if b > 0 else None, "launch_s": float(c),
            "n_samples": len(samples), "rms_residual_s": float(np.sqrt(err / len(samples))),
            "max_relative_error": float(np.max(np.abs(predicted - y) / y)), "tf32": tf32}


def _usable(fit: dict) -> dict:
    """A fit's efficiency for `estimate` (an unidentified term keeps its spec-sheet rate)."""
    return {k: fit[k] for k in ("compute", "memory", "launch_s") if fit.get(k) is not None}


def load_calibration(path: str | Path = REFERENCE) -> dict:
    """GPU key -> fitted efficiency (with provenance), from the reference JSON if any."""
    path = Path(path)
    return json.loads(path.read_text()).get("gpus", {}) if path.exists() else {}


def transfer_seconds(transfer_bytes: int, gpu: GPU | str) -> float:
    """Seconds the host link takes for `transfer_bytes` (both directions together, each
    byte at one direction's rate); estimated, uncalibrated."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    return transfer_bytes / (gpu.host_link_gbs * 1e9)


def collective_link_gbs(world_size: int, gpu: GPU | str) -> float:
    """GB/s per direction a ring of `world_size` ranks of `gpu` runs at: NVLink inside a
    node (world_size <= GPUS_PER_NODE), else bounded by the inter-node link (an assumption,
    `INTER_NODE_GBS`)."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    return gpu.peer_link_gbs if world_size <= GPUS_PER_NODE else min(gpu.peer_link_gbs, INTER_NODE_GBS)


def collective_seconds(wire_bytes: int, world_size: int, gpu: GPU | str) -> float:
    """Seconds a step's collectives take on `world_size` ranks of `gpu`: `wire_bytes` (what
    each rank sends, `bench.measure.collectives`) at one direction's rate of the ring's link
    (`collective_link_gbs`); estimated, uncalibrated (no latency, no overlap)."""
    return wire_bytes / (collective_link_gbs(world_size, gpu) * 1e9)


def estimate_row(cost: dict | None, tokens: int, gpu: str = DEFAULT_GPU,
                 calibration: dict | None = None, prefix: str = "est",
                 transfer_bytes: int | None = None) -> dict:
    """`<prefix>_step_time_s`, `<prefix>_tokens_per_s` and `<prefix>_calibrated` (whether
    `calibration` had `gpu`) of a step of `tokens` tokens with this cost on `gpu`; with
    `transfer_bytes` (host <-> device per step), `<prefix>_transfer_s` and the step's two
    bounds: `<prefix>_step_time_serial_s` (no overlap: added) and
    `<prefix>_step_time_overlap_s` (full overlap: the larger of the two)."""
    keys = [f"{prefix}_step_time_s", f"{prefix}_tokens_per_s", f"{prefix}_calibrated"]
    transfer_keys = [f"{prefix}_transfer_s", f"{prefix}_step_time_serial_s", f"{prefix}_step_time_overlap_s"]
    if not cost or not cost.get("per_op") or not tokens:
        return dict.fromkeys(keys + transfer_keys)
    fit = (calibration or {}).get(gpu)
    seconds = estimate(cost["per_op"], gpu, _usable(fit) if fit else None)
    moved = transfer_seconds(transfer_bytes, gpu) if transfer_bytes is not None else None
    bounds = (moved, seconds + moved, max(seconds, moved)) if moved is not None else (None,) * 3
    return dict(zip(keys + transfer_keys, (seconds, tokens / seconds, bool(fit), *bounds)))


# -- calibration from result files ---------------------------------------------------------
def _job_key(record: dict) -> tuple:
    job = record["job"]
    return (job["method"], job["model"], job["batch_size"], job["seq_len"], job["dtype"],
            json.dumps(record.get("hparams", {}), sort_keys=True))


def samples_from_records(records: list[dict], device_contains: str) -> list[tuple]:
    """(per_op, measured median step time) for every throughput job run on a device whose
    name contains `device_contains` that has a memory job of the same method, model,
    batch, sequence length, dtype and hyperparameters with a cost (any tier: the cost is
    the same)."""
    costs = {_job_key(r): r["cost"]["per_op"] for r in records
             if r["job"]["kind"] == "memory" and r.get("status") == "ok" and r.get("cost")}
    return [(costs[_job_key(r)], r["throughput"]["step_time_median_s"]) for r in records
            if r["job"]["kind"] == "throughput" and r.get("status") == "ok"
            and device_contains.lower() in (r.get("provenance", {}).get("device_name") or "").lower()
            and _job_key(r) in costs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="membench estimate", description=(
        "Fit a GPU's efficiency factors (estimated step time vs measured) from result JSON "
        "files holding throughput jobs on that GPU and memory jobs (with costs) of the same jobs."))
    p.add_argument("results", nargs="+")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS))
    p.add_argument("--device-contains", required=True, help="e.g. H100: which throughput rows")
    p.add_argument("--out", default=str(REFERENCE))
    args = p.parse_args(argv)
    from bench.measure import records

    samples = samples_from_records([records.read(f) for f in args.results], args.device_contains)
    if len(samples) < 3:
        print(f"estimate: {len(samples)} matched jobs; at least 3 are needed", file=sys.stderr)
        return 1
    fit = fit_efficiency(samples, args.gpu)
    fit["fitted_from"] = sorted(args.results)
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.exists() else {"gpus": {}}
    table["gpus"][args.gpu] = fit
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"estimate: {args.gpu} fitted on {len(samples)} jobs: {fit}", file=sys.stderr)
    return 0

