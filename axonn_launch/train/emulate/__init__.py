"""Emulated ranks (``train.emulate=true``): the job's control path at a per-rank cost small
enough for thousands of ranks on one machine.

``run_emulated(spec)`` runs in each task the launcher started. A host task runs its ranks
(``hosting.py``), each an ``EmulatedRank`` (``rank.py``) on a thread of its own beside its
watchdog's; an idle task ends at once. The host of rank 0 starts torch's TCPStore server;
no other host imports torch. Each host writes ``logs/emulate/host_<rank>.json``: its
ranks, its CPU seconds and peak memory, and when each phase was reached.

Which phases are real and which are emulated: ``docs/scale.md`` ("Emulated ranks").
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable

from axonn_launch.common.jobdir import (
    JobPaths,
    record_failure,
    write_json_atomically,
    write_summary,
)
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.emulate.hosting import Hosting, hosting, rendezvous_address
from axonn_launch.train.emulate.rank import EmulatedRank
from axonn_launch.train.emulate.store import TIMEOUT_S, start_server

log = logging.getLogger(__name__)

FAILED_EXIT = 1  # a host one of whose ranks raised ends with this code, as a failed rank


def run_emulated(
    spec: JobSpec,
    *,
    should_stop: Callable[[], bool] | None = None,
    start_logging: Callable[[int, str], object] = lambda rank, job_dir: None,
) -> dict:
    """This task's emulated ranks, run to their end; rank 0's summary where it is hosted
    here (written to summary.json, as the job's), else the first hosted rank's.
    ``start_logging(rank, job_dir)`` sets up the host's log as the first hosted rank's
    (``train/logs.setup_logging``, a module above this folder)."""
    started, started_at = time.monotonic(), time.time()
    host = hosting(spec, os.environ)
    if not host.ranks:
        return {"steps": 0, "stopped": False, "emulated": "idle task"}
    start_logging(host.ranks[0], spec.job_dir)
    address = rendezvous_address(spec, os.environ)
    server = start_server(*address, host.world_size, TIMEOUT_S) if 0 in host.ranks else None
    log.info("emulating ranks %d-%d of %d in process %d (store %s:%d)",
             host.ranks[0], host.ranks[-1], host.world_size, os.getpid(), *address)  # fmt: skip
    stop = should_stop or (lambda: False)
    ranks = [EmulatedRank(spec, host, r, dict(os.environ), stop) for r in host.ranks]
    summaries = run_ranks(spec, ranks, address, started)
    del server  # the store outlives every rank of this host
    summary = summaries[0] | {"emulated": host_record(spec, host, ranks, started, started_at)}
    if host.ranks[0] == 0:
        write_summary(spec.job_dir, summary)
    return summary


def run_ranks(
    spec: JobSpec, ranks: list[EmulatedRank], address: tuple[str, int], started: float
) -> list[dict]:
    """Each rank on its own thread; a rank that raises records its failure and ends the
    host (as a failed rank ends the job's step)."""
    results: dict[int, dict] = {}

    def run(rank: EmulatedRank) -> None:
        try:
            results[rank.rank] = rank.run(address, started)
        except BaseException as error:
            log.error("rank %d failed: %s: %s", rank.rank, type(error).__name__, error)
            record_failure(spec.job_dir, rank.rank, error, getattr(error, "evidence", None))
            logging.shutdown()
            os._exit(FAILED_EXIT)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r.rank}") for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=1.0)  # the main thread keeps taking signals
    return [results[r.rank] for r in ranks]


def host_record(
    spec: JobSpec, host: Hosting, ranks: list[EmulatedRank], started: float, started_at: float
) -> dict:
    """What hosting cost: CPU seconds and peak memory, in all and per rank; the phases, in
    seconds from ``started_at`` (the host's start, seconds since the epoch)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s, rss_mb = usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024
    record = {
        "task": host.task,
        "node": ranks[0].node,
        "ranks": [host.ranks[0], host.ranks[-1]],
        "world_size": host.world_size,
        "started_at": round(started_at, 3),
        "wall_s": round(time.monotonic() - started, 3),
        "cpu_s": round(cpu_s, 3),
        "peak_rss_mb": round(rss_mb, 1),
        "cpu_s_per_rank": round(cpu_s / len(ranks), 4),
        "rss_mb_per_rank": round(rss_mb / len(ranks), 2),
        "torch_imported": "torch" in sys.modules,
        "phases_s": ranks[0].phases,
    }
    write_json_atomically(JobPaths(spec.job_dir).emulated_host(host.ranks[0]), record)
    return record
