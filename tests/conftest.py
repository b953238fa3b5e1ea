import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for every test: on a shared 2-core machine, waiting for a busy
    second core makes each of the many small operations of these tests far slower than
    running alone (timed and end-to-end runs set their own threads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_batch(n: int, t: int, vocab: int = 256, seed: int = 0) -> dict:
    """A language-model batch of random tokens, labels shifted by one (last one ignored)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "labels": labels}


def grads(module, x, dy):
    """Output and input gradient of `module` at `x` for the output gradient `dy`."""
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


def saved_bytes(fn, *inputs, exclude=()):
    """Bytes autograd saves for backward while running fn(*inputs), each storage once,
    parameters (in `exclude`) left out."""
    import torch

    skip = {t.untyped_storage()._cdata for t in exclude}
    storages = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            storages[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(storages.values())


@pytest.fixture
def tiny_job():
    """A factory for small, fast jobs on the CPU. A test about activation memory asks for
    batch 16 x 64: at 4 x 32 the optimizer step (foreach, as on CUDA) makes the peak."""
    from bench.job import Job

    def make(**kw):
        base = dict(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32)
        return Job(**{**base, **kw})

    return make


WORKFLOW_PARTS = ("Snakefile", "pyproject.toml", "bench", "methods", "config", "profiles",
                  "paper/claims.yaml")


def copy_workflow(dest):
    import shutil

    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / part)
    return dest


@pytest.fixture
def workflow_copy(tmp_path):
    """A fresh copy of the workflow (no results yet) in a temporary folder."""
    return copy_workflow(tmp_path)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """A copy of the workflow after one uninterrupted run of the smoke suite (shared: the
    end-to-end test reads it, the resume test compares with it); the run's output too."""
    root = copy_workflow(tmp_path_factory.mktemp("smoke"))
    return root, snakemake(root, "--cores", "2", "--config", "suite=smoke")


def snakemake(workdir, *args, timeout=600):
    import subprocess

    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir,
                          capture_output=True, text=True, timeout=timeout)


def job_counts(output: str) -> dict:
    """Rule -> job count from the 'Job stats' table Snakemake prints."""
    counts, in_table = {}, False
    for line in output.splitlines():
        parts = line.split()
        if parts[:2] == ["job", "count"]:
            in_table = True
        elif in_table and len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
        elif in_table and counts and not parts:
            break
    return counts
