"""One emulated rank: the job's control path around a model whose compute is a sleep.

Real here: the rank's variables read as the job reads them (``common/ranks.py``), the
rendezvous on the job's TCPStore, the watchdog with its sections, deadlines, relayed
request, heartbeats, stack dumps and hang record, the straggler scores, the metrics
and timeline lines, the checkpoint's files and their publication, failure records and
the stop on a signal. Emulated: each step's compute (``train.emulate_step_s`` of sleep),
the step-boundary all-reduce and the straggler all-gather (through the store), the
checkpoint's bytes (``emulate/checkpoint.py``). No process group, groups or model exist.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

from axonn_launch.common.jobdir import (
    JobPaths,
    append_line,
    append_timeline,
    checkpointed_step,
    metrics_through,
)
from axonn_launch.common.ranks import environment_rank, node_name
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.emulate.checkpoint import prepare, publish, real_bytes_per_rank, write_shard
from axonn_launch.train.emulate.hosting import Hosting, rank_environ
from axonn_launch.train.emulate.store import INIT_KEY, TIMEOUT_S, StoreClient
from axonn_launch.train.health.watchdog import (
    Watchdog,
    checkpoint_deadline,
    persistent,
    step_deadline,
    straggler_line,
    straggler_report,
    write_stragglers,
)

log = logging.getLogger(__name__)

STOP_VOTE = 1 << 32  # added to the step's count by a rank asked to stop


class EmulatedRank:
    def __init__(
        self,
        spec: JobSpec,
        host: Hosting,
        rank: int,
        environ: dict[str, str],
        should_stop: Callable[[], bool],
    ) -> None:
        env = rank_environ(environ, host, rank)
        found = environment_rank(env)  # the job's own reading of a rank's variables
        self.spec, self.rank, self.local_rank = spec, found.rank, found.local_rank
        self.world, self.node, self.should_stop = host.world_size, node_name(env), should_stop
        self.node_ranks, self.first = host.node_ranks, host.ranks[0]
        self.started = time.monotonic()
        self.paths = JobPaths(spec.job_dir)
        self.store: StoreClient | None = None
        self.watchdog: Watchdog | None = None
        self.suspects: set[int] = set()
        self.pending_stragglers: dict | None = None
        self.phases: dict[str, float] = {}  # phase -> seconds since the host started

    # the watchdog's sections (as train/health/monitor.StepMonitor moves them)

    def enter(self, name: str, step: int, deadline_s: float) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(name, step, deadline_s)

    def mark(self, name: str) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(name)

    def phase(self, name: str, started: float) -> None:
        self.phases.setdefault(name, round(time.monotonic() - started, 3))

    # the run

    def run(self, address: tuple[str, int], started: float) -> dict:
        self.started = started
        cfg = self.spec.train.watchdog
        if cfg.enabled:
            self.watchdog = Watchdog(cfg, self.spec.job_dir, rank=self.rank,
                                     world_size=self.world, node=self.node).start()  # fmt: skip
        try:
            self.rendezvous(address, started)
            return self.train(started)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.store is not None:
                self.store.close()

    def rendezvous(self, address: tuple[str, int], started: float) -> None:
        """Join the store as a worker of the job's TCPStore joins, then wait for all."""
        self.store = StoreClient(*address, TIMEOUT_S)
        self.store.add(INIT_KEY, 1, bare=True)
        self.store.barrier("emulate/rendezvous", self.world)
        self.phase("rendezvous", started)

    def train(self, started: float) -> dict:
        train, cfg = self.spec.train, self.spec.train.watchdog
        start = step = checkpointed_step(self.spec.job_dir)
        if self.rank == 0:
            self.truncate_metrics(start)
        timed: list[float] = []
        works: list[float] = []
        stopped = False
        while step < train.steps:
            began, t0 = time.time(), time.perf_counter()
            self.enter("data", step + 1, step_deadline(cfg, timed, len(timed)))
            self.mark("compute")
            time.sleep(train.emulate_step_s)  # the model's forward, backward and optimizer
            works.append(time.perf_counter() - t0)
            self.mark("sync")
            stop = self.agree(step + 1, self.should_stop())
            step += 1
            timed.append(time.perf_counter() - t0)
            self.phase("first_step", started)
            if train.stragglers.every > 0 and step % train.stragglers.every == 0:
                self.exchange(step, works)
                works = []
            if self.rank == 0:
                self.record(step, timed[-1], began)
            final = stop or step == train.steps
            if final or (train.checkpoint_every and step % train.checkpoint_every == 0):
                self.save(step)
                self.phase("first_checkpoint", started)
            if stop:
                said = log.info if self.rank == self.first else log.debug  # a line per host
                said("rank %d: stopped after step %d on request; checkpoint saved", self.rank, step)
                stopped = True
                break
        return self.summary(step, start, timed, stopped)

    def agree(self, step: int, stop: bool) -> bool:
        """The step-boundary all-reduce: every rank arrives, and any rank's stop counts."""
        store = self.store
        count = store.add(f"step/{step}", 1 + (STOP_VOTE if stop else 0))
        if count % STOP_VOTE == self.world:
            store.set(f"step/{step}/done", str(count).encode())
        return int(store.get(f"step/{step}/done")) >= STOP_VOTE

    def exchange(self, step: int, works: list[float]) -> None:
        """The straggler exchange: each rank's least own work in the window; rank 0 scores."""
        mine = [min(works), 0.0, self.node]
        self.store.set(f"stragglers/{step}/{self.rank}", json.dumps(mine).encode())
        if self.rank != 0:
            return
        keys = [f"stragglers/{step}/{r}" for r in range(self.world)]
        work, blocked, nodes = zip(
            *(json.loads(v) for v in self.store.multi_get(keys)), strict=True
        )
        cfg = self.spec.train.stragglers
        report = straggler_report(list(work), list(nodes), cfg, step, blocked=list(blocked))
        report, self.suspects = persistent(report, self.suspects)
        self.phase("first_straggler_exchange", self.started)
        if report["stragglers"]:
            log.warning(straggler_line(report))
            write_stragglers(self.spec.job_dir, report)
            self.pending_stragglers = report

    def record(self, step: int, elapsed: float, began: float) -> None:
        """Rank 0's metrics line (no loss: there is no model) and timeline event."""
        tokens = self.spec.train.global_batch * self.spec.train.seq_len
        row = {"step": step, "loss": None, "lr": None, "grad_norm": None, "emulated": True,
               "step_time_s": elapsed, "tokens_per_s": tokens / elapsed}  # fmt: skip
        if self.pending_stragglers:
            row["stragglers"], self.pending_stragglers = self.pending_stragglers, None
        append_line(self.paths.metrics, json.dumps(row))
        append_timeline(self.spec.job_dir, {"start": began, "end": time.time(), "step": step})

    def truncate_metrics(self, start: int) -> None:
        """On resume, the rows past the checkpoint go (as ``train/run.truncate_metrics``)."""
        if self.paths.metrics.exists():
            kept, _ = metrics_through(self.paths.metrics, start)
            self.paths.metrics.write_text("".join(line + "\n" for line in kept))

    def save(self, step: int) -> None:
        """Every rank's file, then rank 0 publishes; on the watchdog's checkpoint clock."""
        spec, store, began = self.spec, self.store, time.time()
        per_node = real_bytes_per_rank(spec) * self.node_ranks
        self.enter("checkpoint", step, checkpoint_deadline(spec.train.watchdog, per_node))
        if self.rank == 0:
            prepare(spec.job_dir, step)
        store.barrier(f"checkpoint/{step}/staged", self.world)
        write_shard(spec.job_dir, step, self.rank, real_bytes_per_rank(spec))
        store.barrier(f"checkpoint/{step}/written", self.world)
        if self.rank == 0:
            meta = {
                "grid": asdict(spec.grid),
                "world_size": self.world,
                "model": asdict(spec.model),
            }
            publish(spec, step, meta)
            append_timeline(spec.job_dir, {"start": began, "end": time.time(), "checkpoint": step})
        store.barrier(f"checkpoint/{step}/published", self.world)

    def summary(self, step: int, start: int, timed: list[float], stopped: bool) -> dict:
        measured = timed[1:] if len(timed) > 1 else timed
        seconds = sum(measured) or float("nan")
        tokens = self.spec.train.global_batch * self.spec.train.seq_len * len(measured)
        return {
            "steps": step,
            "steps_run": len(timed),
            "resumed_from": start,
            "final_loss": None,
            "tokens_per_s": tokens / seconds if measured else None,
            "step_time_s": seconds / len(measured) if measured else None,
            "elapsed_s": sum(timed),
            "stopped": stopped,
        }
