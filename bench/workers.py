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
    _short_socket_folder()
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(preload)  # read when the server starts (the first process)
    return forkserver


def _short_socket_folder() -> None:
    """The fork server listens on a Unix socket in a folder `multiprocessing` makes under
    TMPDIR (`pymp-*/listener-*`, 32 characters more); a socket path longer than Linux allows
    (107 bytes) fails to bind. Where TMPDIR is that long (a cluster's per-job scratch
    folder), the folder is made under /tmp instead (once: the process keeps it)."""
    import os
    import tempfile
    from multiprocessing import util

    if len(os.path.join(tempfile.gettempdir(), "pymp-12345678", "listener-12345678")) < 100:
        return
    saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()  # made now; multiprocessing keeps it for this process
    finally:
        tempfile.tempdir = saved
