"""Worker processes started from one fork server: a fresh interpreter, started once per
process that asks, that imports a preload list (torch, transformers' model code, the bench
code) and never runs a tensor operation, so no thread pool is forked. Each worker is a fork
of it: the ~7 s of imports on a slow core are paid once, not once per worker (`membench
fit`'s method workers, a real sharded run's ranks, `membench many`'s worker after a job
that ended its process)."""
from __future__ import annotations

import multiprocessing

PRELOAD = ["bench.fit", "bench.measure.sharded", "bench.measure.step", "bench.method",
           "transformers.modeling_utils"]


def context(preload: list[str] = PRELOAD):
    """The `multiprocessing` context whose processes the fork server forks, which imports
    `preload` as it starts. A process has one fork server: the list of its first start is
    the one used."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(preload)  # read when the server starts (the first process)
    return forkserver
