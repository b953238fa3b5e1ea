"""`membench` (or `python -m bench`): one command, its subcommands listed by `--help`.

Each subcommand is a module's `main(argv)`; this file only dispatches, importing the
module a subcommand names when it is called (so `membench --help` starts fast).
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, what it does)
COMMANDS = {
    "fit": ("bench.fit", "main", "does a model fit on GPUs of given sizes, per method (simulated)"),
    "run": ("bench.run", "main", "run one job and write its result JSON"),
    "many": ("bench.many", "main",
             "run a group of jobs in one watched process (the workflow's rules)"),
    "estimate": ("bench.estimate", "main",
                 "fit a GPU's efficiency factors for the estimated tier from its measured results"),
    "compare": ("bench.report.compare", "main", "compare two summary.csv files cell by cell"),
    "aggregate": ("bench.report.aggregate", "main", "result JSONs -> results/summary.csv and curves.csv"),
    "figures": ("bench.report.figures", "main", "summary.csv and curves.csv -> results/figures/"),
    "report": ("bench.report.markdown", "main", "summary.csv -> the report paper/results.md"),
    "article": ("bench.report.article", "main",
                "summaries -> the article (article.md, figures, article.html, PDF): paper/"),
    "throughput-capacity": ("bench.report.fig_throughput_capacity", "main",
                            "the figure of estimated tokens/s at each method's largest batch"),
    "fewbit-tables": ("methods.fewbit.tables", "main", "derive Few-Bit's optimal derivative tables"),
    "fewbit-compare": ("methods.fewbit.compare", "main", "our Few-Bit tables beside the published ones"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: membench COMMAND [ARGS...]   (or python -m bench COMMAND ...)", "",
             "Benchmarks of memory-reduction methods for training. Commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    lines += ["", "`membench COMMAND --help` explains one. The whole suite runs as a workflow: "
                  "snakemake --cores all"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"membench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), function)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
