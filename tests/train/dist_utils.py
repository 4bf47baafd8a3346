"""Run a function on N local processes joined by a gloo process group.

``run_world(fn, n, *args)`` spawns N processes; each calls ``fn(rank, world_size, *args)``
after ``init_process_group("gloo")`` and sends back its return value (which must be
picklable). The first failing rank's traceback is raised in the caller and the other
ranks are stopped; a world that runs past ``timeout`` seconds is stopped as well.
``fn`` must be importable (a module-level function) because the children are started
from a fork server (``multiprocessing``'s ``forkserver``): one process per pytest process
that imports torch, the job side and these helpers once (``PRELOAD``), and forks every rank
of every world from there, so that a rank does not pay ``import torch`` again: the imports
of a local job's zygote (``axonn_launch/train/zygote.py``), frozen as it freezes them
(``tests/train/preload_done.py``). The server only imports, so each rank still starts
with fresh module state; it gets the caller's environment of the moment (``os.environ``
at the call, as a spawned child would).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from axonn_launch.train import zygote

# what a local job's zygote imports before it forks its ranks, then these helpers; the last
# entry freezes what the imports made, as the zygote does
PRELOAD = [
    *zygote.RANK_IMPORTS,
    "tests.train.dist_utils",
    *(["transformers"] if importlib.util.find_spec("transformers") else []),
    "tests.train.preload_done",
]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def forkserver_context():
    """The multiprocessing context of the preloaded fork server, for tests that start
    processes of their own (``torch.multiprocessing.start_processes`` takes its name)."""
    return _CONTEXT


class WorldFailure(AssertionError):
    """A rank raised, died, or the world timed out."""


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; return the per-rank results in rank order."""
    ctx = _CONTEXT
    results_queue = ctx.Queue()
    # a file store: a free port picked here can be taken by another test before rank 0
    # listens on it (EADDRINUSE under the suite's parallel workers)
    store = Path(tempfile.mkdtemp(prefix="world_")) / "store"
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, f"file://{store}", results_queue, args, environ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        results = _collect(procs, results_queue, world_size, time.monotonic() + timeout, timeout)
    except BaseException:
        _stop(procs, grace=0.0)  # the others may wait forever in a collective
        raise
    _stop(procs, grace=10.0)
    shutil.rmtree(store.parent, ignore_errors=True)
    return [results[rank] for rank in range(world_size)]


def _collect(procs, results_queue, world_size: int, deadline: float, timeout: float) -> dict:
    results: dict[int, Any] = {}
    while len(results) < world_size:
        if time.monotonic() > deadline:
            raise WorldFailure(f"world of {world_size} ranks timed out after {timeout:.0f}s")
        try:
            rank, ok, payload = results_queue.get(timeout=0.5)
        except queue.Empty:
            _fail_if_died_silently(procs, results)
            continue
        if not ok:
            raise WorldFailure(f"rank {rank} of {world_size} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    return results


def _fail_if_died_silently(procs, results: dict) -> None:
    for rank, proc in enumerate(procs):
        if rank not in results and proc.exitcode not in (None, 0):
            raise WorldFailure(f"rank {rank} exited with code {proc.exitcode} without a result")


def _stop(procs, grace: float) -> None:
    for proc in procs:
        proc.join(timeout=grace)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _child(fn, rank: int, world_size: int, init: str, results_queue, args, environ) -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=init,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        # plain pickle (the tensors' bytes), not torch's shared-memory reduction, whose file
        # descriptor the parent fetches from this process: it may have exited by then
        result = pickle.dumps(fn(rank, world_size, *args))
        results_queue.put((rank, True, result))
    except BaseException:
        results_queue.put((rank, False, traceback.format_exc()))
        return
    dist.destroy_process_group()
