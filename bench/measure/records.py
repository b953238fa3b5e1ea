"""Result files: provenance and atomic writes.

One job writes one JSON file. It is written to a temporary file in the same folder and
renamed into place, so a reader (or Snakemake) never sees half a result. A pre-training
run (`save_weights`) also writes its model's weights beside it (`weights_path`), first.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1
REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD's hash, with `-dirty` when tracked files differ from it; outside git (a copy of
    the tree), the environment's MEMBENCH_COMMIT, else `unknown`."""
    if os.environ.get("MEMBENCH_COMMIT"):
        return os.environ["MEMBENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info(device: str) -> dict:
    """Name and, where it applies, memory and driver of the device a job ran on."""
    import torch

    if device.startswith("cuda"):
        index = torch.device(device).index
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
        except (OSError, subprocess.CalledProcessError):
            driver = "unknown"
        return {"device_name": props.name, "device_memory_bytes": int(props.total_memory),
                "cuda_version": torch.version.cuda, "driver_version": driver}
    info = cpu_fields()
    name = info.get("model name") or platform.processor() or platform.machine()
    return {"device_name": f"{name} ({os.cpu_count()} cores)", "cpu_id": cpu_id(info)}


def cpu_fields() -> dict:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def cpu_id(info: dict) -> str | None:
    """What tells two CPUs of one model name apart (a virtual machine's name is often just
    the vendor's line, e.g. "AMD EPYC"): family, model and stepping (the generation) and the
    clock. Two 2-core hosts both named "AMD EPYC (2 cores)" ran the quick suite 2x apart."""
    parts = [f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info]
    if "cpu MHz" in info:
        parts.append(f"{float(info['cpu MHz']):.0f} MHz")
    return ", ".join(parts) or None


def provenance(device: str) -> dict:
    import torch
    import transformers

    return {
        "commit": git_commit(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
        **device_info(device),
    }


def failure(job, status: str, message: str, wall_time_s: float | None = None) -> dict:
    """The result of a job that could not write its own (ended from outside, or past its
    time limit where no handler of its own ran): the job, the status and why, provenance.
    `hparams` holds the job's overrides only (the method was never built here)."""
    return {"schema_version": SCHEMA_VERSION, "job": job.to_dict(), "hparams": dict(job.hparams),
            "status": status, "message": message, "provenance": provenance(job.device),
            "wall_time_s": wall_time_s}


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; once the block succeeds it is renamed onto
    `path`, so a reader never sees a half-written file. On failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_atomic(path: str | Path, data: dict) -> None:
    """One result as JSON (NaN and infinity refused), written atomically; its `weights`
    (a state dict, from a job that saves them) go to `weights_path(path)` before it."""
    if "weights" in data:
        data = dict(data)
        import torch

        with atomic_path(weights_path(path)) as tmp:
            torch.save(data.pop("weights"), tmp)
    write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def weights_path(result: str | Path) -> str:
    """Where a job that saves weights (`save_weights`) writes them: its result's path,
    ending .pt; the result is their provenance."""
    return str(Path(result).with_suffix(".pt"))


def read(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)
