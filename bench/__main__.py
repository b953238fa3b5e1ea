"""Command line: run one job and write its result file.

    python -m bench --kind memory --method grad_accum --model gpt2-tiny \\
        --batch-size 8 --seq-len 128 --out results/runs/example.json

`python -m bench fit ...` (`membench fit`) asks instead whether a model fits on GPUs of
given sizes, for every method: `bench.fit`.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.measure import records as results
from bench.method import available
from bench.models import MODELS, is_known
from bench.data import TASKS
from bench.job import DTYPE_NAMES, KINDS, Job
from bench.measure.runner import run


def parse_hparam(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _model(name: str) -> str:
    if not is_known(name):
        raise argparse.ArgumentTypeError(f"unknown model {name!r}")
    return name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run one membench job (one method, one model, one kind of measurement) "
                    "and write one JSON result with its provenance. A method that fails, runs "
                    "out of memory or diverges still writes a result, with that status; the "
                    "exit code is 0 so a workflow goes on.",
        epilog="kinds: memory = peak bytes by category over a warm-up and a measured step; "
               "throughput = median step time over timed steps after warm-up; "
               "convergence = loss per step; capacity = largest batch that fits each of --memory-gb; "
               "model_capacity = largest size of the model's family that trains at --batch-size "
               "in each of --memory-gb. "
               "Methods: " + ", ".join(available()) +
               " (stack with '+', e.g. checkpointing+grad_accum; fix hyperparameters with '@', "
               "e.g. galore@rank=8). "
               "Does a model fit on a GPU, per method? `python -m bench fit --help`.")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--method", required=True, help="method module name or a+b stack")
    p.add_argument("--model", required=True, type=_model, metavar="MODEL",
                   help="one of: " + ", ".join(MODELS) + "; or any width and depth of a family "
                        "as <family>-d<width>-l<layers>[-v<vocab>], e.g. llama-d3072-l28; "
                        "model_capacity: the first size of the ladder searched")
    p.add_argument("--batch-size", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--out", required=True, help="result JSON path (written atomically)")
    p.add_argument("--seed", type=int, default=0, help="seeds model init and data (default 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="parameter dtype")
    p.add_argument("--task", default="markov", choices=sorted(TASKS), help="training data (default markov)")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--dropout", type=float, default=None, help="override the model's dropout")
    p.add_argument("--hparam", type=parse_hparam, action="append", default=[], metavar="KEY=VALUE",
                   help="override a method hyperparameter (JSON value), repeatable")
    p.add_argument("--capacity-gb", type=float, default=None,
                   help="memory capacity in GiB: over it the job records status oom")
    p.add_argument("--simulate", action="store_true",
                   help="memory and capacity kinds: run the step on fake tensors (no memory is "
                        "allocated; tier 'simulated'), so paper-sized models fit on a laptop; "
                        "what a GPU would need is predicted by a model of CUDA's caching allocator")
    p.add_argument("--memory-gb", type=float, nargs="+", default=[], metavar="GB",
                   help="capacity kinds: memory sizes in GiB to find the largest batch (or "
                        "model) for; capacity: --batch-size is then the largest batch tried")
    p.add_argument("--steps", type=int, default=100, help="convergence: steps; throughput: timed steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="throughput: untimed steps first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fit"]:
        from bench import fit

        return fit.main(argv[1:])
    args = parser().parse_args(argv)
    method = args.method
    unknown = [m for m in (part.partition("@")[0] for part in method.split("+")) if m not in available()]
    if unknown:
        parser().error(f"unknown method {unknown[0]!r}; available: {', '.join(available())}")
    job = Job(kind=args.kind, method=method, model=args.model, batch_size=args.batch_size,
              seq_len=args.seq_len, seed=args.seed, device=args.device, dtype=args.dtype,
              task=args.task, attn_implementation=args.attn_implementation, dropout=args.dropout,
              hparams=dict(args.hparam), capacity_gb=args.capacity_gb, steps=args.steps,
              warmup_steps=args.warmup_steps, threads=args.threads, simulate=args.simulate,
              memory_gb=args.memory_gb)
    print(f"membench: {job.kind} {job.method} on {job.model} (batch {job.batch_size}, "
          f"seq {job.seq_len}, seed {job.seed}, {job.device})", file=sys.stderr, flush=True)
    record = run(job)
    results.write_atomic(args.out, record)
    print(f"membench: status {record['status']}"
          + (f" ({record['message']})" if record["message"] else "")
          + f", {record['wall_time_s']:.1f} s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
