# membench: config -> one job per (method, model, batch, seed, kind) -> result JSON
# -> results/summary.csv + results/curves.csv -> results/figures/ -> paper/results.md
# -> results/paper/article.{md,html} (the article; paper/article.* is the references')
#
#   snakemake --cores all                          # the quick suite (CPU, minutes)
#   snakemake --cores all --config suite=full      # papers' sizes on a GPU
#   snakemake -n                                   # list the jobs without running them
import glob
import json
import math
import sys

import yaml

from snakemake.utils import min_version

min_version("9.0")
from bench import recovery  # before Snakemake checks its lock: a dead run's lock is removed
recovery.at_parse(workflow)  # (bench/recovery.py says when it is safe), this run recorded

from bench.suite import PRIORITY, ConfigError, check, groups, rule_name
from bench.measure.records import weights_path

configfile: "config/config.yaml"
try:
    # the one validation: schema, its defaults filled, names, types, capabilities
    checked, JOBS = check(config)
    config.update(checked)
except ConfigError as e:
    raise WorkflowError(f"bad config: {e}") from None
recovery.set_aside_unreadable(JOBS, workflow)  # a planned result that cannot be read runs again

PYTHON = sys.executable
# each figure (bench.report.figures.FIGURES, the same names: tests/unit/test_plots.py) and its
# section of the HTML report; read here, so that planning does not import the plotting libraries
CATEGORIES = yaml.safe_load(open("bench/report/captions/categories.yaml"))
FIGURES = list(CATEGORIES)
# The tables gather this suite's jobs and every other suite's results on disk (a
# result of this suite that it no longer plans is left out: it cannot be remade).
SUITE_DIR = f"results/runs/{config['suite']}/"
RESULTS = sorted(set(JOBS) | {p for p in glob.glob("results/runs/*/*/*/*/*.json")
                              if not p.startswith(SUITE_DIR)})
CUDA = config["suites"][config["suite"]]["device"].startswith("cuda")


GROUPS = groups(JOBS, config["suite"])


def all_cores(wildcards) -> int:
    # Timed jobs run alone, on every core: nothing else competes with the clock. Under a
    # cluster executor the cores are those of the node the job lands on, known only inside
    # the job (it runs with --cores all); profiles/slurm gives it that node to itself.
    cores = workflow.resource_settings.cores
    return cores if cores and cores != sys.maxsize else 1


# What a group's jobs ask a cluster for (profiles/slurm): the sum of its jobs' time limits
# (Job.time_limit: a kind's limit is generous for the papers' sizes), at most 48 hours; 4 GB
# of host memory (the largest peak RSS measured: 0.46 GB for a simulated LLaMA-65B step,
# 1.7 GB for a GPU job); twice both on a retry.
def minutes(paths) -> int:
    return min(math.ceil(sum(JOBS[p].time_limit() for p in paths) / 60), 2880)


rule all:
    default_target: True
    input:
        list(JOBS),  # named here too, so a deleted result is run again
        "results/summary.csv",
        expand("results/figures/{name}.{ext}", name=FIGURES, ext=["png", "pdf"]),
        "paper/results.md",
        "results/paper/article.html",


# One rule per group of jobs that share a process (bench.suite.groups): the memory jobs of
# a model, the seeds of a convergence cell, every other job alone. Each job's result is
# written atomically as soon as it ends; a deleted result reruns its group.
for gid, paths in GROUPS.items():
    kind = JOBS[paths[0]].kind

    rule:
        name: rule_name(gid)
        message: f"{kind}: {gid.split('/', 1)[1]} ({len(paths)} job{'s' if len(paths) > 1 else ''})"
        # fine-tuning jobs wait for the weights their pre-training run saves beside its result,
        # tuned jobs for the grid runs they choose their learning rate from (bench/tuning.py)
        input: sorted({JOBS[p].init for p in paths if JOBS[p].init} | {t for p in paths for t in JOBS[p].tuned_from})
        output: paths + [weights_path(p) for p in paths if JOBS[p].save_weights]
        priority: PRIORITY[kind]
        log: f"results/logs/{gid}.log"
        benchmark: f"results/logs/{gid}.benchmark.tsv"  # the group's wall time
        params: jobs=json.dumps([{"job": JOBS[p].to_dict(), "out": p} for p in paths], separators=(",", ":"))
        # timed jobs run alone, on every core: nothing else competes with the clock (beside
        # another job on 2 cores, two quick runs' ratios differed by a median |log| 0.035;
        # alone, 0.021-0.023: results/reference/cpu-2core/README.md); a group's throughput
        # jobs are one panel beside one baseline (bench.measure.timing)
        threads: all_cores if kind == "throughput" else 1
        resources:
            gpu=1 if CUDA else 0,  # becomes --gpus=1 under SLURM: one job per GPU
            mem_mb=lambda wildcards, attempt: 4096 * attempt,
            runtime=lambda wildcards, attempt, m=minutes(paths): m * attempt,
            slurm_extra="--exclusive" if kind == "throughput" else "",  # a timed job's node to itself
        # the group's jobs go on the command line: a `shell` rule runs in this process's
        # executor, where a `run` block would start a second Snakemake per group
        shell: "{PYTHON} -m bench many --jobs-json {params.jobs:q} --threads {threads} 2> {log}"


rule aggregate:
    message: "collecting {} results".format(len(RESULTS))
    input: RESULTS
    output:
        summary="results/summary.csv",
        curves="results/curves.csv",
    log: "results/logs/aggregate.log"
    shell: "{PYTHON} -m bench aggregate --summary {output.summary} --curves {output.curves} {input} 2> {log}"


rule figures:
    message: "drawing figures"
    input:
        summary="results/summary.csv",
        curves="results/curves.csv",
    output:
        # the HTML report (snakemake --report report.html) shows each figure with its caption
        # (the same file the Markdown report reads), in its question's section
        [report(f"results/figures/{name}.png", caption=f"bench/report/captions/{name}.rst",
                category=CATEGORIES[name]) for name in FIGURES],
        expand("results/figures/{name}.pdf", name=FIGURES),
    log: "results/logs/figures.log"
    shell: "{PYTHON} -m bench figures --summary {input.summary} --curves {input.curves} --out results/figures 2> {log}"


rule paper:
    message: "writing paper/results.md"
    input:
        summary="results/summary.csv",
        claims="paper/claims.yaml",
        figures=expand("results/figures/{name}.png", name=FIGURES),
    output: "paper/results.md"
    shell: "{PYTHON} -m bench report --summary {input.summary} --claims {input.claims} --out {output}"


# The article (bench/report/article.py): findings, recommendations per GPU memory size, the
# claims audit and how much to trust the numbers, from this run's summary; article.md,
# its figures and article.html (and article.pdf where WeasyPrint is installed). paper/
# holds the one made from the committed references (paper/sources.yaml).
rule article:
    message: "writing results/paper/article.md and article.html"
    input:
        summary="results/summary.csv",
        curves="results/curves.csv",
        claims="paper/claims.yaml",
    output:
        md="results/paper/article.md",
        html="results/paper/article.html",
    log: "results/logs/article.log"
    shell: "{PYTHON} -m bench article --summary {input.summary} --curves {input.curves} --claims {input.claims} "
           "--out results/paper 2> {log}"
