# membench: config -> one job per (method, model, batch, seed, kind) -> result JSON
# -> results/summary.csv + results/curves.csv -> results/figures/ -> paper/results.md
#
#   snakemake --cores all                          # quick profile (CPU, minutes)
#   snakemake --cores all --config profile=full --resources gpu=1   # papers' sizes on a GPU
#   snakemake -n                                   # list the jobs without running them
import glob
import re
import sys

from snakemake.utils import min_version, validate

min_version("9.0")

from bench.suite import ConfigError, plan, validate_schema
from bench.report.figures import FIGURES

configfile: "config/config.yaml"
try:
    validate_schema(config)  # a short message naming the bad key
    JOBS = plan(config)  # names of methods, models, profiles, hyperparameters
except ConfigError as e:
    raise WorkflowError(f"bad config: {e}") from None
validate(config, "config/schema.yaml")  # Snakemake's check; fills the schema's defaults

PYTHON = sys.executable
# The tables gather this profile's jobs and every other profile's results on disk (a
# result of this profile that it no longer plans is left out: it cannot be remade).
PROFILE_DIR = f"results/runs/{config['profile']}/"
RESULTS = sorted(set(JOBS) | {p for p in glob.glob("results/runs/*/*/*/*/*.json")
                              if not p.startswith(PROFILE_DIR)})
CUDA = config["profiles"][config["profile"]]["device"].startswith("cuda")


def job_args(wildcards, output):
    return " ".join(JOBS[output[0]])


def job_threads(wildcards):
    # Timed jobs run alone, on every core: nothing else competes with the clock. Under a
    # cluster executor the cores are those of the node the job lands on, known only inside
    # the job (it runs with --cores all); profiles/slurm gives it that node to itself.
    if wildcards.kind != "throughput":
        return 1
    cores = workflow.resource_settings.cores
    return cores if cores and cores != sys.maxsize else 1


rule all:
    default_target: True
    input:
        list(JOBS),  # named here too, so a deleted result is run again
        "results/summary.csv",
        expand("results/figures/{name}.{ext}", name=FIGURES, ext=["png", "pdf"]),
        "paper/results.md",


rule run_job:
    message: "{wildcards.kind}: {wildcards.method} on {wildcards.model} ({wildcards.cell})"
    output: "results/runs/{profile}/{kind}/{model}/{method}/{cell}.json"
    log: "results/logs/{profile}/{kind}/{model}/{method}/{cell}.log"
    # only this profile's results are made here; other profiles' are read as they are
    wildcard_constraints: profile=re.escape(config["profile"])
    params: args=job_args
    threads: job_threads
    resources: gpu=1 if CUDA else 0
    shell: "{PYTHON} -m bench {params.args} --threads {threads} --out {output} 2> {log}"


rule aggregate:
    message: "collecting {} results".format(len(RESULTS))
    input: RESULTS
    output:
        summary="results/summary.csv",
        curves="results/curves.csv",
    log: "results/logs/aggregate.log"
    shell: "{PYTHON} -m bench.report.aggregate --summary {output.summary} --curves {output.curves} {input} 2> {log}"


rule figures:
    message: "drawing figures"
    input:
        summary="results/summary.csv",
        curves="results/curves.csv",
    output: expand("results/figures/{name}.{ext}", name=FIGURES, ext=["png", "pdf"])
    log: "results/logs/figures.log"
    shell: "{PYTHON} -m bench.report.figures --summary {input.summary} --curves {input.curves} --out results/figures 2> {log}"


rule paper:
    message: "writing paper/results.md"
    input:
        summary="results/summary.csv",
        claims="paper/claims.yaml",
        figures=expand("results/figures/{name}.png", name=FIGURES),
    output: "paper/results.md"
    shell: "{PYTHON} -m bench.report.markdown --summary {input.summary} --claims {input.claims} --out {output}"
