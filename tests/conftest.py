import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """Which tests share a worker under `--dist loadgroup` (pyproject's addopts): the tests
    of one `xdist_group`, and (without a group of their own) the tests of one module that
    need a module-scoped fixture (not an autouse one): such a fixture is made once, not on
    each worker that runs one of its tests (a real multi-process run, a `membench fit`).

    xdist sends a group to one worker by the `@group` suffix of its tests' node ids.
    pytest-xdist 3.8 adds it by setting `item._nodeid`, which pytest 9 no longer reads (a
    node's id is `item._id`): the groups were split over both workers, and what they share
    (the smoke run) was made on each. Here the suffix is added where it is missing."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers only
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9: xdist's own renaming works (module fixtures stay per worker)
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        group = "_".join(names) if names else _module_fixture_group(item)
        if group and not item.nodeid.endswith("@" + group):
            item._id = NodeId.parse(f"{item.nodeid}@{group}")


def _module_fixture_group(item) -> str | None:
    """The test's module path if it needs a module-scoped fixture that is not autouse."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope == "module" and not getattr(defs[-1], "_autouse", True):
            return "module-fixtures-" + item.nodeid.split("::")[0]
    return None


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


# Packages that allocate a small tensor once per process, in the first step that needs it
# (galore-torch: 128 bytes of `other` in its first real run, none in later ones, none on
# fake tensors): their real run is measured after one run that pays it, so a result does
# not depend on which tests ran before it in the process.
FIRST_USE = {"galore_torch"}
# ROAM's planner at a twentieth of its default budget (solver units): the same code plans,
# captures and lays out the step; the plan is as reproducible, only less searched
PAIR_HPARAMS = {"roam": {"time_limit": 0.05}}
_PAIRS: dict = {}


def memory_pair(method: str, model: str = "gpt2-tiny") -> tuple[dict, dict]:
    """The tracked and the simulated memory job of `method` on `model` (tiny_job's batch,
    4 x 32), each run once per process: tests/methods/test_simulated.py compares their
    bytes, tests/unit/test_cost.py their FLOPs and bytes moved. The tests that read one
    pair carry `pair_group(method, model)`, which puts them on one worker."""
    if (method, model) not in _PAIRS:
        from bench.job import Job
        from bench.measure import runner

        job = dict(kind="memory", method=method, model=model, batch_size=4, seq_len=32,
                   hparams=PAIR_HPARAMS.get(method, {}))
        if method in FIRST_USE:  # its one-time allocation lands in the first run of a process
            runner.run(Job(**job))
        _PAIRS[method, model] = runner.run(Job(**job)), runner.run(Job(**job, simulate=True))
    return _PAIRS[method, model]


def pair_group(method: str, model: str = "gpt2-tiny"):
    """The xdist group of the tests that read memory_pair(method, model)."""
    return pytest.mark.xdist_group(f"memory-pair-{method}-{model}")


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


SMOKE = ("--cores", "2", "--config", "suite=smoke")
KILLED_GROUP = "/memory/"  # the group in flight when the smoke run is killed (it runs last: bench.suite.PRIORITY)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The smoke suite run as a user whose run died runs it: the command, killed once the
    memory group has written one of its results (SIGKILL to its whole process group, as a
    closed terminal or the kernel's OOM killer would), then the same command again, which
    finishes it. Shared: the end-to-end test reads the finished run (a copy of the
    workflow), the resume test what the kill left. -> (root, the second run's output,
    `killed`: the run's state just after the kill)."""
    import os
    import signal
    import subprocess
    import time

    root = copy_workflow(tmp_path_factory.mktemp("smoke"))
    runs, state = root / "results" / "runs", root / ".snakemake"
    first = subprocess.Popen([sys.executable, "-m", "snakemake", *SMOKE], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 400
    while first.poll() is None and time.monotonic() < deadline and not (
            any(KILLED_GROUP in str(p) for p in runs.rglob("*.json")) and any((state / "incomplete").glob("*"))):
        time.sleep(0.05)
    running = first.poll() is None
    if running:
        os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed = {"running": running, "results": {p: p.read_bytes() for p in runs.rglob("*.json")},
              "locks": list((state / "locks").glob("*.lock")), "incomplete": marked_incomplete(state)}
    # files a reader cannot use, beside the suite's (the tables leave them out)
    foreign = runs / "elsewhere" / "memory" / "gpt2-tiny" / "adamw"
    foreign.mkdir(parents=True)
    (foreign / "truncated.json").write_text('{"schema_version": 1, "job": {"kind": "mem')
    (foreign / "notes.json").write_text(json.dumps({"title": "my notes"}))
    return root, snakemake(root, *SMOKE), killed


def marked_incomplete(state) -> set[str]:
    """The outputs Snakemake has marked incomplete (their job started and has not finished):
    each marker under .snakemake/incomplete is named by the output's path in URL-safe base64
    (split into folders of at most 255 characters, each but the last starting with '@')."""
    import base64

    base = state / "incomplete"
    return {base64.urlsafe_b64decode("".join(part.removeprefix("@") for part in p.relative_to(base).parts)).decode()
            for p in base.rglob("*") if p.is_file() and p.name != "migration_underway"}


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
