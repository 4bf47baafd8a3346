"""Fault injection for tests of failure handling, driven by one environment variable.

``AXONN_FAULT`` holds comma-separated faults; unset or empty, nothing happens. Examples:
``AXONN_FAULT=collective@step5:rank1``, ``AXONN_FAULT=pause@step9:120``,
``AXONN_FAULT=slow@preflight:node=n2``. The job calls ``step_hook`` once per optimizer
step (``submit/task.TrainJob`` wraps the loop's ``should_stop`` with it) and the
preflight asks ``preflight_slowdown``.

Every kind of fault, its syntax and when it fires: ``docs/recovery.md``
("train/health/faults.py").
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from axonn_launch.common.ranks import node_name

ENV_VAR = "AXONN_FAULT"
KINDS = (
    "collective", "gpu_oom", "code", "pause", "slow", "exit", "kill", "oom",
    "hang", "straggle", "nan_loss", "nan_grad",
)  # fmt: skip
EVERY_RANK = ("pause", "slow")
NUMERIC = ("nan_loss", "nan_grad")  # fire inside the step, on its tensors (``poisons``)
REPEATING = ("slow", "straggle")  # fire in step N and every later step
STEP, PREFLIGHT = "step", "preflight"  # when a fault fires
PREFLIGHT_KINDS = ("slow",)
DEFAULT_SLOWDOWN = 8
_FAULT = re.compile(
    r"(?P<kind>\w+)@(?:step(?P<step>\d+)|(?P<preflight>preflight))"
    r"(?::rank(?P<rank>\d+)|:node=(?P<node>[A-Za-z0-9][\w.-]*))?(?::(?P<arg>\d+))?"
    r"(?::attempt(?P<attempt>\d+))?"
)
SYNTAX = (
    "KIND@stepN[:rankR|:node=NODE][:SECONDS][:attemptA]"
    " or slow@preflight[:rankR|:node=NODE][:FACTOR]"
)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # 0 for a preflight fault
    rank: int | None = None  # None: the default for the kind (or every rank of ``node``)
    arg: int | None = None
    when: str = STEP  # STEP | PREFLIGHT
    node: str | None = None  # fires on every rank of this node
    attempt: int | None = None  # fires only in this attempt of the run (None: in each)

    def fires_on(self, rank: int, node: str | None = None) -> bool:
        if self.node is not None:
            return node == self.node
        if self.rank is not None:
            return rank == self.rank
        return self.kind in EVERY_RANK or rank == 0

    def fires_after(self, step: int) -> bool:
        return step >= self.step if self.kind in REPEATING else step == self.step


def parse(text: str) -> list[Fault]:
    """Faults from ``AXONN_FAULT``'s syntax; raises ValueError on anything else."""
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        found = _FAULT.fullmatch(item)
        preflight = bool(found and found["preflight"])
        kinds = PREFLIGHT_KINDS if preflight else KINDS
        if not found or found["kind"] not in kinds:
            raise ValueError(
                f"{ENV_VAR}={text!r}: {item!r} is not {SYNTAX} with KIND one of {', '.join(KINDS)}"
            )
        faults.append(
            Fault(
                kind=found["kind"],
                step=0 if preflight else int(found["step"]),
                rank=int(found["rank"]) if found["rank"] else None,
                arg=int(found["arg"]) if found["arg"] else None,
                when=PREFLIGHT if preflight else STEP,
                node=found["node"],
                attempt=int(found["attempt"]) if found["attempt"] else None,
            )
        )
    return faults


def _first_run(environ) -> bool:
    return int(environ.get("SLURM_RESTART_COUNT") or 0) == 0


def preflight_slowdown(*, rank: int, node: str, environ=os.environ) -> int:
    """How many times its normal work each preflight GEMM of this rank does (1: no fault)."""
    if not _first_run(environ):
        return 1
    factors = [
        f.arg or DEFAULT_SLOWDOWN
        for f in parse(environ.get(ENV_VAR, ""))
        if f.when == PREFLIGHT and f.fires_on(rank, node)
    ]
    if factors:
        print(f"{ENV_VAR}: preflight GEMMs on rank {rank} ({node}) do {max(factors)}x the work")
    return max(factors, default=1)


class StopFlag:
    """A ``should_stop`` hook that a signal handler can set (only assigns a bool)."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_: object) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def step_hook(
    should_stop: Callable[[], bool],
    *,
    rank: int,
    start_step: int,
    attempt: int = 1,
    environ=os.environ,
) -> Callable[[], bool]:
    """Wrap the loop's per-step ``should_stop`` so that the configured faults fire.

    ``should_stop`` is called once per optimizer step, so the n-th call after resuming
    from ``start_step`` follows step ``start_step + n``.
    """
    faults = [f for f in my_faults(rank, attempt, environ) if f.kind not in NUMERIC]
    if not faults:
        return should_stop
    calls = [start_step]

    def hook() -> bool:
        calls[0] += 1
        for fault in faults:
            if fault.fires_after(calls[0]):
                inject(fault, rank)
        return should_stop()

    return hook


def my_faults(rank: int, attempt: int, environ=os.environ) -> list[Fault]:
    """The step faults of ``AXONN_FAULT`` that fire on this rank in this attempt."""
    faults = [f for f in parse(environ.get(ENV_VAR, "")) if f.when == STEP]
    if not faults or not _first_run(environ):
        return []
    node = node_name(environ) if any(f.node is not None for f in faults) else None
    return [f for f in faults if f.fires_on(rank, node) and f.attempt in (None, attempt)]


def poisons(*, rank: int, attempt: int = 1, environ=os.environ) -> dict[int, str]:
    """Step -> ``nan_loss`` or ``nan_grad``: the numeric faults of this rank, which the loop
    applies to the step's tensors."""
    return {f.step: f.kind for f in my_faults(rank, attempt, environ) if f.kind in NUMERIC}


def burn(seconds: float) -> None:
    """Busy work for ``seconds`` (CPU time, not a sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def inject(fault: Fault, rank: int) -> None:
    if fault.kind == "slow":
        time.sleep(fault.arg or 1)
        return
    if fault.kind == "straggle":
        burn((fault.arg or 100) / 1000)
        return
    print(f"{ENV_VAR}: injecting {fault.kind} after step {fault.step} on rank {rank}", flush=True)
    if fault.kind == "pause":
        time.sleep(fault.arg or 600)
        return
    if fault.kind == "hang":
        time.sleep(fault.arg or 3600)
        return
    if fault.kind == "exit":
        sys.stdout.flush()
        os._exit(fault.arg or 1)
    if fault.kind == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "oom":
        exhaust_cgroup_memory()
    raise make_error(fault.kind, rank)


OOM_CHUNK = 64 << 20


def exhaust_cgroup_memory() -> None:
    """Hold ever more touched memory until the OOM killer ends this process; refused (a
    RuntimeError) outside a memory cgroup whose limit is below this computer's memory."""
    from axonn_launch.common import hostmem

    group = hostmem.memory_cgroup()
    rooms = hostmem.cgroup_rooms(group) if group is not None else []
    if not rooms:
        raise RuntimeError(
            f"{ENV_VAR}: oom needs a memory cgroup with a limit (none holds this process):"
            " allocating until killed would exhaust the whole computer"
        )
    held = []
    while True:  # bytes repeated are written, so every page counts against the limit
        held.append(b"\x01" * OOM_CHUNK)


def make_error(kind: str, rank: int) -> Exception:
    """The exception a real fault of ``kind`` raises, with the library's own wording."""
    import torch

    if kind == "collective":
        return torch.distributed.DistBackendError(
            f"NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with"
            f" NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call"
            f" (e.g. socket, malloc) or external library call failed or device error.\n"
            f"Last error: socket receive failed on rank {rank} (injected by {ENV_VAR})"
        )
    if kind == "gpu_oom":
        return torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of"
            " 79.15 GiB of which 1.06 GiB is free. Of the allocated memory 75.20 GiB is"
            f" allocated by PyTorch (injected by {ENV_VAR})"
        )
    return ValueError(f"injected code error on rank {rank} ({ENV_VAR})")
