"""The DAG on a real SLURM cluster, through snakemake-executor-plugin-slurm (profiles/slurm).

Needs SLURM: `sbatch` on PATH and a controller that answers. `sudo scripts/slurm-local.sh up`
starts a single-node one on this machine (Debian's packages); then

    pytest -m slow tests/integration/test_slurm.py

Without SLURM these tests are skipped, with the reason. MEMBENCH_SLURM_SETUP=1 lets them
start the local cluster themselves when run as root (skipped, not failed, when apt or the
daemons do not come up). They take minutes: every job of the smoke preset is a SLURM job,
two at a time on a 2-core machine. MEMBENCH_SLURM_PROFILE names the cluster's own profile
(default profiles/slurm-local, for the local cluster) to run them on a real one.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import suite
from bench.suite import rule_name
from conftest import REPO, job_counts, snakemake

pytestmark = pytest.mark.slow

# The preset, named in this one place (the config key too).
SUITE_KEY, SUITE = "suite", "smoke"
PRESET = ("--config", f"{SUITE_KEY}={SUITE}")
CLUSTER_PROFILE = os.environ.get("MEMBENCH_SLURM_PROFILE", "profiles/slurm-local")
SLURM = ("--profile", CLUSTER_PROFILE, "--workflow-profile", "profiles/slurm")
SUBMITTED = "has been submitted with SLURM jobid"
TIMEOUT = 1800  # seconds for one snakemake run: a loaded 2-core machine runs 2 jobs at a time


def controller_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ping.returncode == 0 and "is UP" in ping.stdout


@pytest.fixture(scope="module")
def slurm():
    """Skip unless SLURM answers (or, asked to, this machine's local cluster comes up)."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install snakemake-executor-plugin-slurm")
    if controller_up():
        return
    script = REPO / "scripts" / "slurm-local.sh"
    if os.environ.get("MEMBENCH_SLURM_SETUP") != "1":
        pytest.skip("no SLURM controller answering (start one: sudo scripts/slurm-local.sh up; "
                    "or set MEMBENCH_SLURM_SETUP=1 to let this test do it as root)")
    if os.geteuid() != 0:
        pytest.skip("MEMBENCH_SLURM_SETUP=1 needs root to install and start SLURM")
    try:
        up = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"scripts/slurm-local.sh up did not run: {e}")
    if up.returncode != 0 or not controller_up():
        pytest.skip(f"scripts/slurm-local.sh up failed: {(up.stdout + up.stderr)[-500:]}")


def results(workdir: Path) -> dict:
    """Relative path -> parsed result, for every result of the preset."""
    runs = workdir / "results" / "runs" / SUITE
    return {str(p.relative_to(runs)): json.loads(p.read_text()) for p in sorted(runs.rglob("*.json"))}


TIMED = ("throughput_ratio", "round_ratios")  # ratios of timings


def without_timings(record):
    """A result less what differs between two runs of the same job: provenance (host,
    date, commit) and every timing (all named *_s: wall_time_s, wall_s, tokens_per_s, ...,
    and the paired throughput ratios)."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items()
                if k != "provenance" and not k.endswith("_s") and not k.startswith(TIMED)}
    if isinstance(record, list):
        return [without_timings(v) for v in record]
    return record


def plan_of(workdir: Path) -> dict:
    config = suite.load(workdir / "config" / "config.yaml")
    return suite.plan({**config, SUITE_KEY: SUITE})


def planned(workdir: Path) -> list[str]:
    return sorted(plan_of(workdir))


def stray_files(workdir: Path) -> list[str]:
    """Anything under results/runs that is not a finished result (a half-written file)."""
    runs = workdir / "results" / "runs"
    return [str(p) for p in runs.rglob("*") if p.is_file() and p.suffix != ".json"]


def test_smoke_through_slurm_matches_local(slurm, workflow_copy, tmp_path_factory):
    local = tmp_path_factory.mktemp("local")
    shutil.copytree(workflow_copy, local, dirs_exist_ok=True)

    out = snakemake(workflow_copy, *SLURM, *PRESET, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout + out.stderr
    # every job but the local target rule `all` went through sbatch
    counts = job_counts(log)
    assert log.count(SUBMITTED) == counts["total"] - counts["all"], log[-4000:]

    ran = snakemake(local, "--cores", "all", *PRESET, timeout=TIMEOUT)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert SUBMITTED not in ran.stdout + ran.stderr

    on_slurm, here = results(workflow_copy), results(local)
    expected = {str(Path(p).relative_to(Path("results/runs") / SUITE)) for p in planned(workflow_copy)}
    assert set(on_slurm) == set(here) == expected
    for name in expected:
        assert on_slurm[name]["status"] == "ok", (name, on_slurm[name]["message"])
        assert without_timings(on_slurm[name]) == without_timings(here[name]), name
    # the timings are there, and were taken (not copied): the runs differ in them
    assert all(r["wall_time_s"] > 0 for r in on_slurm.values())
    assert any(on_slurm[n]["provenance"]["date"] != here[n]["provenance"]["date"] for n in expected)

    for product in ("results/summary.csv", "results/curves.csv", "paper/results.md"):
        assert (workflow_copy / product).stat().st_size > 0, product
    assert not stray_files(workflow_copy)


def _running(workdir: Path) -> dict:
    """SLURM job id -> comment for this workflow's jobs that are RUNNING."""
    q = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%k|%Z"],
                       capture_output=True, text=True, timeout=30)
    jobs = {}
    for line in q.stdout.splitlines():
        job_id, comment, cwd = line.split("|", 2)
        if Path(cwd).resolve() == workdir.resolve():
            jobs[job_id] = comment
    return jobs


def test_cancelled_job_reruns_with_nothing_lost(slurm, workflow_copy):
    # the preset's convergence jobs (the longest of its kinds; the seeds of a method share a
    # group, one rule and one SLURM job): one group is cancelled mid-run
    targets = [p for p in planned(workflow_copy) if "/convergence/" in p]
    jobs = plan_of(workflow_copy)
    groups = suite.groups({t: jobs[t] for t in targets}, SUITE)
    assert len(groups) >= 2
    # the comment the plugin gives each job starts with rule_<rule name>
    by_comment = {f"rule_{rule_name(gid)}": gid for gid in groups}

    cmd = [sys.executable, "-m", "snakemake", *SLURM, *PRESET, "--retries", "0", "--", *targets]
    first = subprocess.Popen(cmd, cwd=workflow_copy, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    victim = job_id = None
    deadline = time.monotonic() + TIMEOUT
    try:
        while victim is None and first.poll() is None and time.monotonic() < deadline:
            for jid, comment in _running(workflow_copy).items():
                gid = next((g for c, g in by_comment.items() if comment.startswith(c)), None)
                if gid is None:
                    continue
                log = workflow_copy / f"results/logs/{gid}.log"
                # its command has started (the log is opened by the job's shell), not finished
                if log.exists() and not all((workflow_copy / t).exists() for t in groups[gid]):
                    victim, job_id = gid, jid
                    break
            time.sleep(0.5)
        assert victim is not None, "no job of this run was seen running"
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        output, _ = first.communicate(timeout=TIMEOUT)
    finally:
        if first.poll() is None:
            first.kill()

    # the run goes on without it, then fails, naming the job and SLURM's state
    assert first.returncode != 0, output[-3000:]
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in output, output[-3000:]
    assert rule_name(victim) in output
    assert not stray_files(workflow_copy)  # no half result, nor a temporary file left behind
    survivors = {t: (workflow_copy / t).stat().st_mtime_ns for t in targets
                 if t not in groups[victim]}
    assert survivors and all(json.loads((workflow_copy / t).read_text())["status"] == "ok" for t in survivors)

    rerun = snakemake(workflow_copy, *SLURM, *PRESET, "--", *targets, timeout=TIMEOUT)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    log = rerun.stdout + rerun.stderr
    assert log.count(SUBMITTED) == 1 and job_counts(log) == {rule_name(victim): 1, "total": 1}, log[-3000:]
    assert all(json.loads((workflow_copy / t).read_text())["status"] == "ok" for t in groups[victim])
    # nothing lost: the jobs that had finished are there, untouched
    assert {t: (workflow_copy / t).stat().st_mtime_ns for t in survivors} == survivors
    assert not stray_files(workflow_copy)


def test_job_over_its_memory_is_a_named_failure(slurm, workflow_copy):
    """SLURM's cgroup kills a job over its --mem from outside (SIGKILL): no code of the job
    runs after it, so there is no result row; Snakemake fails the job with SLURM's state
    and names both logs, and leaves no file behind. (The profile retries such a job once
    with twice the memory; --retries 0 shows the failure itself.)"""
    target = next(p for p in planned(workflow_copy) if "/memory/" in p)
    gid, paths = next((g, ps) for g, ps in suite.groups(plan_of(workflow_copy), SUITE).items()
                      if target in ps)
    out = snakemake(workflow_copy, *SLURM, *PRESET, "--retries", "0",
                    "--set-resources", f"{rule_name(gid)}:mem_mb=150", "--", target, timeout=TIMEOUT)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert "SLURM status is: 'OUT_OF_MEMORY'" in log, log[-3000:]
    assert f"results/logs/{gid}.log" in log and f".snakemake/slurm_logs/rule_{rule_name(gid)}/" in log
    assert not any((workflow_copy / p).exists() for p in paths)
    assert not stray_files(workflow_copy)
