"""The one way the job side times a kernel: calibrate, the preflight check and the GEMM
tuner all use it.

GPU kernels run asynchronously, so a host clock read around a call measures only its
launch: ``elapsed`` waits for the device before starting the clock and again before
stopping it. ``per_call_seconds`` times calls queued back to back with CUDA events, which
measure each kernel on the device without a host wait between calls. The statistic
(median, best, slowest rank) stays with the caller: each asks a different question.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait until the kernels queued on ``device`` have run (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(
    fn: Callable[[], object],
    device: torch.device,
    *,
    clock: Callable[[], float] = time.perf_counter,
    ready: Callable[[], object] | None = None,
) -> float:
    """Seconds ``clock`` advances over ``fn()``, from an idle device to an idle device.

    ``ready`` runs once the device is idle, just before the clock starts (calibrate: a
    barrier, so that every rank starts together)."""
    synchronize(device)
    if ready is not None:
        ready()
    start = clock()
    fn()
    synchronize(device)
    return clock() - start


def per_call_seconds(
    fn: Callable[[], object], device: torch.device, reps: int, *, warmup: int = 0
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones: CUDA
    events on a GPU, the host clock around each call otherwise."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    torch.cuda.synchronize(device)
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in "se") for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1000 for start, end in events]
