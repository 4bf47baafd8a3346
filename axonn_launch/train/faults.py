"""Fault injection for tests of failure handling, driven by one environment variable.

``AXONN_FAULT`` holds comma-separated faults ``KIND@stepN[:rankR][:SECONDS]``; unset or
empty, nothing happens. A fault fires once, on the step boundary after optimizer step N
(1-based), on rank R (default: every rank for ``pause`` and ``slow``, rank 0 otherwise),
and only in a job's first run (not after Slurm requeued it: ``SLURM_RESTART_COUNT`` > 0):

- ``collective``: raise the error a failed NCCL/RCCL collective raises
- ``gpu_oom``: raise the error of a CUDA allocation that does not fit
- ``code``: raise a plain ``ValueError`` (a bug in user code or configuration)
- ``pause``: sleep SECONDS (default 600) so a test can kill, cancel or stop a node while
  the job is mid-training
- ``slow``: sleep SECONDS (default 1) after step N and after every later step, so that a
  short job reaches its time limit
- ``exit``: end the process at once with ``os._exit(SECONDS or 1)`` (a crash outside Python)

Examples: ``AXONN_FAULT=collective@step5:rank1``, ``AXONN_FAULT=pause@step9:120``.
The job calls ``step_hook`` once per optimizer step (``axonn_launch.job.TrainJob`` wraps
the loop's ``should_stop`` with it).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

ENV_VAR = "AXONN_FAULT"
KINDS = ("collective", "gpu_oom", "code", "pause", "slow", "exit")
EVERY_RANK = ("pause", "slow")
_FAULT = re.compile(r"(?P<kind>\w+)@step(?P<step>\d+)(?::rank(?P<rank>\d+))?(?::(?P<arg>\d+))?")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: the default for the kind
    arg: int | None = None

    def fires_on(self, rank: int) -> bool:
        if self.rank is not None:
            return rank == self.rank
        return self.kind in EVERY_RANK or rank == 0

    def fires_after(self, step: int) -> bool:
        return step >= self.step if self.kind == "slow" else step == self.step


def parse(text: str) -> list[Fault]:
    """Faults from ``AXONN_FAULT``'s syntax; raises ValueError on anything else."""
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        found = _FAULT.fullmatch(item)
        if not found or found["kind"] not in KINDS:
            raise ValueError(
                f"{ENV_VAR}={text!r}: {item!r} is not KIND@stepN[:rankR][:SECONDS]"
                f" with KIND one of {', '.join(KINDS)}"
            )
        faults.append(
            Fault(
                kind=found["kind"],
                step=int(found["step"]),
                rank=int(found["rank"]) if found["rank"] else None,
                arg=int(found["arg"]) if found["arg"] else None,
            )
        )
    return faults


def step_hook(
    should_stop: Callable[[], bool], *, rank: int, start_step: int, environ=os.environ
) -> Callable[[], bool]:
    """Wrap the loop's per-step ``should_stop`` so that the configured faults fire.

    ``should_stop`` is called once per optimizer step, so the n-th call after resuming
    from ``start_step`` follows step ``start_step + n``.
    """
    faults = [f for f in parse(environ.get(ENV_VAR, "")) if f.fires_on(rank)]
    if not faults or int(environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        return should_stop
    calls = [start_step]

    def hook() -> bool:
        calls[0] += 1
        for fault in faults:
            if fault.fires_after(calls[0]):
                inject(fault, rank)
        return should_stop()

    return hook


def inject(fault: Fault, rank: int) -> None:
    if fault.kind == "slow":
        time.sleep(fault.arg or 1)
        return
    print(f"{ENV_VAR}: injecting {fault.kind} after step {fault.step} on rank {rank}", flush=True)
    if fault.kind == "pause":
        time.sleep(fault.arg or 600)
        return
    if fault.kind == "exit":
        sys.stdout.flush()
        os._exit(fault.arg or 1)
    raise make_error(fault.kind, rank)


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
