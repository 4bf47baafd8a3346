"""Measure what the planner assumes: collective bandwidths per group layout, GEMM speed.

Inside an allocation, one task per GPU:
    srun ... python -m axonn_launch.calibrate machine=frontier out=cal-frontier.json
On this computer, N local gloo processes:
    python -m axonn_launch.calibrate machine=local nproc=4 out=cal-local.json
Then: ``python -m axonn_launch.plan ... calibration=cal-frontier.json``. Without ``out=``
the file goes to a job directory of its own, ``jobs/calibrate-<machine>/<time>/``.

For every power-of-two group size p and every placement the grid axes can have (members
one apart, as an inner axis, or ``stride`` apart, as an outer one), all groups of that
layout run all-reduce, all-gather and reduce-scatter at the same time, as the grid's
groups do in training, at three message sizes; a least-squares line through the times
fits the ring model of ``perf.ring_time``: t = steps * alpha + factor * M / B, giving the
bus bandwidth B and the per-step latency alpha of that (size, ranks per node) layout.
GEMMs of a few square sizes; with ``model=NAME`` also that model's GEMMs at the local
block shapes of the planner's best grids for the job (``nodes=``, ``global_batch=``), in
every distinct layout the job's GEMM tuner chooses from (``measure_gemm_shapes``); and
element-wise adds of a few sizes (memory bandwidth), run
on every rank at once, in blocks long enough that each rank computes while its neighbours
do. Last, the overlap efficiency: how much of an
all-reduce a GEMM running at the same time hides (``measure_overlap``). Every timing is
the slowest rank's in each repetition, then the best of ``reps`` repetitions (other
programs only ever add time): ``_best_seconds``.

torch is imported only inside the measuring functions: the module itself is safe to
import on a login node.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from axonn_launch.cost.perf import (
    ALL_GATHER,
    ALL_REDUCE,
    COLLECTIVES,
    PLAIN_FORMULATION,
    REDUCE_SCATTER,
    BandwidthSample,
    Calibration,
    Gemm,
    planned_gemms,
)
from axonn_launch.usage import help_page, run_tool, wants_help

GPU_GEMM_SIZES = (1024, 2048, 4096, 8192)
CPU_GEMM_SIZES = (64, 128, 256, 512)
GPU_ADD_ELEMENTS = (1 << 18, 1 << 22, 1 << 26)
CPU_ADD_ELEMENTS = (1 << 14, 1 << 17, 1 << 20)


PLAIN = PLAIN_FORMULATION


class CalibrateError(ValueError):
    """A user's mistake or a missing allocation: one line, exit code 2."""


@dataclass(frozen=True)
class Settings:
    machine: str = "local"
    output: str = ""  # default: jobs/calibrate-<machine>/<time>/calibration-<machine>.json
    nproc: int = 0  # >0: spawn this many local processes (gloo) instead of joining a job
    small_bytes: int = 64 * 1024
    large_bytes: int = 0  # 0: 64 MiB on GPUs, 4 MiB on CPUs
    reps: int = 5
    warmup: int = 2
    block_seconds: float = 0.05  # length of one timed block of GEMM or element-wise calls
    gpus_per_node: int = 0  # 0: the machine profile's (local: nproc)
    model: str = ""  # a model preset: also time its GEMMs at the planned grids' shapes
    nodes: int = 0  # nodes of the job to plan those grids for; 0: this allocation's
    global_batch: int = 0  # that job's global batch; 0: the preset's
    gemm_grids: int = 4  # how many of the planner's best grids' GEMM shapes to time

    def output_path(self) -> Path:
        if self.output:
            return Path(self.output)
        when = time.strftime("%Y-%m-%d_%H-%M-%S")
        return Path("jobs", f"calibrate-{self.machine}", when, f"calibration-{self.machine}.json")


KEY_HELP = {
    "machine=NAME": "machine profile: local (default), slurm_local, perlmutter, frontier, alps",
    "out=FILE": "the file to write (or output=); default jobs/calibrate-<machine>/<time>/",
    "nproc=N": "start this many local gloo processes instead of joining srun's tasks",
    "small_bytes=BYTES": "smallest message of each collective (default 64 KiB)",
    "large_bytes=BYTES": "largest message (default 64 MiB on GPUs, 4 MiB on CPUs)",
    "reps=N": "repetitions of each timing; the best counts (default 5)",
    "warmup=N": "untimed calls before each timing (default 2)",
    "block_seconds=S": "length of one timed block of GEMMs or element-wise adds (default 0.05)",
    "gpus_per_node=N": "ranks per node (default: the machine profile's; local: nproc)",
    "model=NAME": "also time every layout of this model's GEMMs at its planned grids' shapes",
    "nodes=N": "plan those grids for N nodes (default: the nodes of this allocation)",
    "global_batch=N": "...and this global batch (default: the model preset's)",
    "gemm_grids=K": "time the GEMM shapes of the planner's K best grids (default 4)",
}
ALIASES = {"out": "output"}


@dataclass(frozen=True)
class Layout:
    size: int
    stride: int
    per_node: int

    def groups(self, world: int) -> list[list[int]]:
        """Partition of the world into groups of ``size`` ranks ``stride`` apart."""
        span = self.size * self.stride
        return [
            [block + offset + i * self.stride for i in range(self.size)]
            for block in range(0, world, span)
            for offset in range(self.stride)
        ]


def layouts(world: int, gpus_per_node: int) -> list[Layout]:
    """One layout per distinct (size, ranks per node) a grid axis can have."""
    found: dict[tuple[int, int], Layout] = {}
    size = 2
    while size <= world:
        stride = 1
        while size * stride <= world:
            if size * stride <= gpus_per_node:
                per_node = size
            else:
                per_node = max(1, min(size, gpus_per_node // stride))
            found.setdefault((size, per_node), Layout(size, stride, per_node))
            stride *= 2
        size *= 2
    return list(found.values())


def fit_ring(collective: str, p: int, sizes: tuple[float, ...], times: tuple[float, ...]):
    """(bus GB/s, alpha in us) fitted to timings at several sizes by least squares.

    The ring model of perf.ring_time is a line in the message size M:
    t = steps * alpha + factor * M / B. A non-positive slope (noise) falls back to the
    largest message alone with alpha = 0.
    """
    steps, factor = (
        (2 * (p - 1), 2 * (p - 1) / p) if collective == ALL_REDUCE else (p - 1, (p - 1) / p)
    )
    xs = [factor * m for m in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - my) for x, t in zip(xs, times, strict=True)) / sxx
    if slope <= 0:
        return xs[-1] / times[-1] / 1e9, 0.0
    alpha = max(0.0, (my - slope * mx) / steps)
    return 1 / slope / 1e9, alpha * 1e6


# --------------------------------------------------------------------------- published


# Bus bandwidths (GB/s) measured by AxoNN and hard-coded in Megatron-AxoNN's
# comm_model.py (axonn.md §4.2), by ip (product of the sizes of the axes inside this one)
# and my (this axis's size); the last row / column stands for everything beyond.
AXONN_BUS_GBPS = {
    "perlmutter": {1: (76, 225, 80, 80), 2: (76, 40, 40, 40), 4: (20, 20, 20, 20)},
    "frontier": {
        1: (129, 52, 135, 40),
        2: (50, 72, 20, 20),
        4: (36, 10, 10, 10),
        8: (5, 5, 5, 5),
    },  # fmt: skip
}


def published_calibration(machine_name: str, gpus_per_node: int, latency_us: float) -> Calibration:
    """AxoNN's measured bus bandwidths as a Calibration (no GEMM numbers): one sample per
    (group size, ranks per node) of every collective, with the profile's latency. A
    (size, per_node) layout takes the row of the smallest ip that gives it."""
    table = AXONN_BUS_GBPS[machine_name]
    samples: dict[tuple[int, int], float] = {}
    size = 2
    while size <= 65536:
        ip = 1
        while ip * size <= 65536:
            row = table[min(ip, max(table))]
            column = min(int(size).bit_length() - 2, 3)  # my = 2, 4, 8, >= 16
            per_node = (
                size if ip * size <= gpus_per_node else max(1, min(size, gpus_per_node // ip))
            )
            samples.setdefault((size, per_node), row[column])
            ip *= 2
        size *= 2
    return Calibration(
        collectives=tuple(
            BandwidthSample(c, size=p, per_node=k, bus_gbps=bw, alpha_us=latency_us)
            for (p, k), bw in samples.items()
            for c in COLLECTIVES
        ),
        source="AxoNN comm_model.py table",
    )


# --------------------------------------------------------------------------- measuring (torch)


def measure(settings: Settings, gpus_per_node: int) -> dict[str, Any] | None:
    """Run every measurement on this rank of an initialized world; rank 0 gets the result."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _current_device()
    large = settings.large_bytes or (64 << 20 if device.type == "cuda" else 4 << 20)
    sizes = (settings.small_bytes, large // 8, large)
    results = []
    phase = Phases(rank)
    todo = layouts(world, gpus_per_node)
    phase(f"{world} ranks ({dist.get_backend()}, {device.type}), {len(todo)} group layouts")
    for i, layout in enumerate(todo):
        phase(
            f"collectives {i + 1}/{len(todo)}: groups of {layout.size},"
            f" {layout.per_node} per node (all-reduce, all-gather, reduce-scatter)"
        )
        group = _own_group(layout, world, rank)
        for collective in COLLECTIVES:
            times = tuple(
                _time_collective(collective, group, layout.size, m, device, settings) for m in sizes
            )
            bus, alpha = fit_ring(collective, layout.size, sizes, times)
            results.append(
                {
                    "collective": collective,
                    "size": layout.size,
                    "per_node": layout.per_node,
                    "stride": layout.stride,
                    "bus_gbps": bus,
                    "alpha_us": alpha,
                    "bytes": list(sizes),
                    "seconds": list(times),
                }  # fmt: skip
            )
    phase("GEMM throughput")
    gemm = measure_gemm(device, settings)
    shapes, planned = gemm_shapes_to_measure(settings, world, gpus_per_node)
    if shapes:
        phase(f"{len(shapes)} GEMM shapes of {settings.model} on {planned}, every layout")
    shaped = measure_gemm_shapes(shapes, device, settings)
    phase("element-wise (memory) throughput")
    elementwise = measure_elementwise(device, settings)
    if world > 1:
        phase("overlap of an all-reduce with GEMMs")
    overlap = measure_overlap(device, settings, large) if world > 1 else None
    if rank != 0:
        return None
    return {
        "machine": settings.machine,
        "world_size": world,
        "gpus_per_node": gpus_per_node,
        "backend": dist.get_backend(),
        "device": device.type,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gemm": gemm,
        **({"gemm_shapes": shaped, "gemm_shapes_for": planned} if shapes else {}),
        "elementwise": elementwise,
        **({"overlap": overlap} if overlap else {}),
        "collectives": results,
    }


class Phases:
    """Rank 0 says what it measures now, with the seconds since the start (also in logs)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.start = rank, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.rank == 0:
            print(f"calibrate [{time.perf_counter() - self.start:6.1f} s] {text}", flush=True)


def _current_device():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _own_group(layout: Layout, world: int, rank: int):
    """Create every group of the layout (collective over the world); return this rank's."""
    import torch.distributed as dist

    own = None
    for ranks in layout.groups(world):
        group = dist.new_group(ranks)
        if rank in ranks:
            own = group
    return own


def _time_collective(
    collective: str, group, p: int, nbytes: int, device, settings: Settings
) -> float:
    """Seconds of one collective of ``nbytes`` (gathered size), as ``_best_seconds``."""
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numel = max(p, nbytes // torch.empty(0, dtype=dtype).element_size() // p * p)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // p, dtype=dtype, device=device)

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def once() -> None:
        if collective == ALL_REDUCE:
            dist.all_reduce(full, group=group)
        elif collective == ALL_GATHER:
            gather(full, shard, group=group)
        elif collective == REDUCE_SCATTER:
            scatter(shard, full, group=group)

    for _ in range(settings.warmup):
        once()
    return _best_seconds(once, device, settings)


def measure_gemm(device, settings: Settings) -> list[list[float]]:
    """[(FLOPs per call, TFLOP/s)] of square GEMMs run on every rank at once; slowest rank.

    Each timing is a block of calls long enough (``block_seconds``) that every rank
    computes through the whole of it while the others do too: the rate a rank keeps
    during a training step, when its neighbours on the node are busy as well. (A single
    short call, timed alone, catches a moment when the rank has a core or the memory
    bus to itself, and on a node whose ranks share cores that overstates it.)
    """
    import torch

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    points = []
    for n in GPU_GEMM_SIZES if on_gpu else CPU_GEMM_SIZES:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        gemm = functools.partial(torch.matmul, a, b)
        calls = _calls_for(gemm, device, settings)
        block = functools.partial(_repeat, gemm, calls)
        seconds = _best_seconds(block, device, settings) / calls
        points.append([float(2 * n**3), 2 * n**3 / seconds / 1e12])
    return points


def gemm_shapes_to_measure(
    settings: Settings, world: int, gpus_per_node: int
) -> tuple[list[Gemm], str]:
    """The distinct GEMM shapes (``perf.planned_gemms``) of the planner's
    ``gemm_grids`` best grids for ``settings.model`` on ``settings.nodes`` nodes (default:
    this allocation's), and a line naming them; none without a model. Torch-free: every
    rank computes the same list."""
    if not settings.model:
        return [], ""
    from axonn_launch.config.compose import load
    from axonn_launch.cost.planner import plan

    overrides = [f"machine={settings.machine}", f"model={settings.model}"]
    if settings.global_batch:
        overrides.append(f"train.global_batch={settings.global_batch}")
    cfg = load(overrides)
    if settings.machine == "local":  # one node of nproc ranks, as in run_local
        hw = replace(cfg.machine.hardware, gpus_per_node=gpus_per_node)
        cfg = replace(cfg, machine=replace(cfg.machine, hardware=hw))
    nodes = settings.nodes or max(1, world // max(1, cfg.machine.hardware.gpus_per_node))
    rows = plan(machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=nodes,
                top=settings.gemm_grids)  # fmt: skip
    shapes: dict[tuple, Gemm] = {}
    for row in rows:
        train = replace(cfg.train, micro_batch=row.micro_batch)
        for g in planned_gemms(cfg.model, row.grid, train):
            shapes.setdefault(g.key, g)
    grids = ", ".join(f"({r.grid.describe()} mb={r.micro_batch})" for r in rows)
    return sorted(shapes.values(), key=lambda g: g.key), f"{nodes} node(s): {grids}"


def measure_gemm_shapes(shapes: list[Gemm], device, settings: Settings) -> list[dict[str, Any]]:
    """TFLOP/s of every distinct formulation (``train/gemm.py``) of each GEMM shape, on
    operands laid out as the training core passes them (``gemm_operands``); the slowest
    rank's time per formulation, all ranks timing at once. Without the tuner module only
    the plain ``a @ b`` ("direct") is timed."""
    import torch.distributed as dist

    out = []
    for g in shapes:
        a, b = gemm_operands(g, device)
        dist.barrier()
        seconds = _slowest(_time_layouts(a, b, settings), device)
        rates = {name: g.flops / t / 1e12 for name, t in seconds.items()}
        best = max(rates, key=rates.__getitem__)
        out.append({"op": g.op, "linear": g.linear, "m": g.m, "n": g.n, "k": g.k,
                    "tflops": rates, "best": best})  # fmt: skip
        del a, b
    return out


def gemm_operands(g: Gemm, device):
    """(A, B) with the training core's storage: forward X @ W^T (W row-major, so B is a
    transposed view), dX = dY @ W, dW = dY^T @ X (A a transposed view)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if g.op == "fwd":
        return rand(g.m, g.k), rand(g.n, g.k).t()
    if g.op == "dx":
        return rand(g.m, g.k), rand(g.k, g.n)
    return rand(g.k, g.m).t(), rand(g.k, g.n)


def _time_layouts(a, b, settings: Settings) -> dict[str, float]:
    """Seconds per call of each distinct formulation of a @ b (gemm.py), else of a @ b."""
    try:
        from axonn_launch.train import gemm
    except ImportError:
        gemm = None
    if gemm is None or not hasattr(gemm, "time_formulations"):
        return {PLAIN: _plain_seconds(a, b, settings)}
    names = gemm.distinct_formulations(a, b)
    if 2 * a.shape[0] * a.shape[1] * b.shape[1] < gemm.MIN_FLOPS:
        names = [PLAIN]  # the job's tuner leaves GEMMs this small as they are
    return gemm.time_formulations(a, b, settings.reps, warmup=settings.warmup, names=names)


def _plain_seconds(a, b, settings: Settings) -> float:
    from axonn_launch.train.timing import elapsed

    for _ in range(settings.warmup):
        a @ b
    return elapsed(lambda: _repeat(lambda: a @ b, settings.reps), a.device) / settings.reps


def _slowest(seconds: dict[str, float], device) -> dict[str, float]:
    """Per name, the largest value over the ranks (every rank passes the same names)."""
    import torch
    import torch.distributed as dist

    names = sorted(seconds)
    t = torch.tensor([seconds[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist(), strict=True))


def measure_elementwise(device, settings: Settings) -> list[list[float]]:
    """[(bytes per kernel, GB/s)] of an element-wise add (two reads, one write) at a few
    sizes, on every rank at once (ranks on one node share its memory bandwidth)."""
    import torch

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    points = []
    for n in GPU_ADD_ELEMENTS if on_gpu else CPU_ADD_ELEMENTS:
        a, b, out = (torch.ones(n, dtype=dtype, device=device) for _ in range(3))
        add = functools.partial(torch.add, a, b, out=out)
        calls = _calls_for(add, device, settings)
        seconds = _best_seconds(functools.partial(_repeat, add, calls), device, settings) / calls
        nbytes = 3 * n * a.element_size()
        points.append([float(nbytes), nbytes / seconds / 1e9])
    return points


def measure_overlap(device, settings: Settings, nbytes: int) -> dict[str, Any]:
    """How much of a collective a GEMM running at the same time hides, on every rank.

    Times, on the slowest rank and best of ``reps``: a block of GEMMs (t_gemm), about as
    long a run of all-reduces of ``nbytes`` over the whole world (t_comm), and both at once
    (the all-reduces issued asynchronously, then the GEMMs, then a wait: t_both). The
    efficiency is (t_gemm + t_comm - t_both) / min(t_gemm, t_comm), clamped to [0, 1]:
    1 when communication runs on its own engines, 0 when it takes the GEMMs' cores.
    """
    import torch
    import torch.distributed as dist

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    n = GPU_GEMM_SIZES[-2] if on_gpu else CPU_GEMM_SIZES[-2]
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    gemm = functools.partial(torch.matmul, a, b)
    calls = _calls_for(gemm, device, settings)
    buffer = torch.ones(max(1, nbytes // a.element_size()), dtype=dtype, device=device)
    reduce = functools.partial(dist.all_reduce, buffer)
    t_gemm = _best_seconds(functools.partial(_repeat, gemm, calls), device, settings)
    t_one = _best_seconds(reduce, device, settings)
    count = torch.tensor([max(1, round(t_gemm / t_one))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    k = int(count.item())
    t_comm = _best_seconds(functools.partial(_repeat, reduce, k), device, settings)

    def both() -> None:
        works = [dist.all_reduce(buffer, async_op=True) for _ in range(k)]
        _repeat(gemm, calls)
        for work in works:
            work.wait()

    t_both = _best_seconds(both, device, settings)
    hidden = (t_gemm + t_comm - t_both) / min(t_gemm, t_comm)
    return {
        "efficiency": min(1.0, max(0.0, hidden)),
        "collective": ALL_REDUCE,
        "size": dist.get_world_size(),
        "bytes": int(buffer.numel() * buffer.element_size()),
        "count": k,
        "gemm_seconds": t_gemm,
        "comm_seconds": t_comm,
        "both_seconds": t_both,
    }


def _repeat(fn, times: int) -> None:
    for _ in range(times):
        fn()


def _best_seconds(fn, device, settings: Settings) -> float:
    """Seconds of ``fn()`` started together on every rank: the slowest rank of each
    repetition, then the best repetition.

    In this order because ranks that share cores are not slowed alike in each repetition:
    one may have a core to itself while the others queue. The best time of each rank on
    its own would pick every rank's lucky repetition and report the speed of a rank with
    no neighbours.
    """
    import torch
    import torch.distributed as dist

    from axonn_launch.train.timing import elapsed

    fn()  # warm-up
    best = float("inf")
    for _ in range(settings.reps):
        seconds = elapsed(fn, device, ready=dist.barrier)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        best = min(best, float(slowest.item()))
    return best


def _calls_for(kernel, device, settings: Settings) -> int:
    """Calls per timed block, agreed by all ranks: enough to last ``block_seconds``."""
    import torch
    import torch.distributed as dist

    from axonn_launch.train.timing import elapsed

    for _ in range(settings.warmup):
        kernel()
    one = max(elapsed(kernel, device), 1e-7)
    calls = torch.tensor([max(2, min(100_000, int(settings.block_seconds / one) + 1))])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    return int(calls.item())


# --------------------------------------------------------------------------- running


def run_in_allocation(settings: Settings) -> None:
    """Join the job's world (srun / torchrun / mpirun variables) and measure."""
    import torch.distributed as dist

    from axonn_launch.common.spec import RuntimeConfig
    from axonn_launch.config.compose import load
    from axonn_launch.train.bootstrap import discover_env, init_distributed

    machine = load([f"machine={settings.machine}"]).machine
    env = discover_env(RuntimeConfig(backend=machine.backend, device_index=machine.device_index))
    check_world(settings, machine.scheduler, env)
    init_distributed(env)
    try:
        gpn = settings.gpus_per_node or machine.hardware.gpus_per_node or env.local_world_size
        _finish(settings, measure(settings, gpn))
    finally:
        dist.destroy_process_group()


def check_world(settings: Settings, scheduler: str, env: Any) -> None:
    """A cluster machine needs srun's tasks and, for nccl, GPUs and a torch built with it."""
    import torch
    import torch.distributed as dist

    where = f"calibrate machine={settings.machine}"
    instead = "run it inside salloc with srun, one task per GPU, or use machine=local nproc=4"
    if scheduler != "local" and env.source == "single":
        raise CalibrateError(f"{where}: needs a GPU allocation (no srun task here); {instead}")
    if env.backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise CalibrateError(
            f"{where}: backend nccl is not available here (torch {torch.__version__},"
            f" {torch.cuda.device_count()} GPUs visible); {instead}"
        )


def run_local(settings: Settings) -> None:
    """Spawn ``settings.nproc`` gloo processes on this computer (one "node") and measure."""
    import torch.multiprocessing as mp

    port = _free_port()
    mp.spawn(_local_worker, args=(settings, port), nprocs=settings.nproc, join=True)


def _local_worker(rank: int, settings: Settings, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.nproc))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=settings.nproc
    )
    try:
        _finish(settings, measure(settings, settings.gpus_per_node or settings.nproc))
    finally:
        dist.destroy_process_group()


def _finish(settings: Settings, result: dict[str, Any] | None) -> None:
    if result is None:
        return
    path = settings.output_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"calibration of {result['world_size']} ranks written to {path}")
    print(f"use it: python -m axonn_launch.plan machine={settings.machine} calibration={path}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HELP = help_page(
    usage="python -m axonn_launch.calibrate [KEY=VALUE ...] [--debug]",
    summary=(
        "Measure what the planner assumes on this machine: all-reduce, all-gather and\n"
        "reduce-scatter bandwidth per group layout, GEMM and element-wise throughput, and how\n"
        "much communication a GEMM hides. Run it under srun, one task per GPU, inside an\n"
        "allocation; or with nproc=N local processes. Feed the file to plan calibration=FILE."
    ),
    keys=list(KEY_HELP.items()) + [("--debug", "show the traceback of an error")],
    examples=[
        "srun -N 2 --ntasks-per-node=4 python -m axonn_launch.calibrate machine=perlmutter",
        "python -m axonn_launch.calibrate machine=local nproc=4",
        "python -m axonn_launch.calibrate machine=local nproc=4 out=cal-local.json",
    ],
)


def parse_args(argv: list[str]) -> Settings:
    fields = Settings.__dataclass_fields__
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = ALIASES.get(key, key)
        if not sep or key not in fields:
            raise CalibrateError(
                f"{arg!r}: expected key=value with key in {', '.join(fields)}"
                " (python -m axonn_launch.calibrate --help)"
            )
        kind = type(fields[key].default)  # str, int or float
        try:
            values[key] = kind(value)
        except ValueError:
            raise CalibrateError(f"{key}={value!r}: expected {kind.__name__}") from None
    return Settings(**values)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    from axonn_launch.config.compose import ConfigError

    return run_tool(_main, argv, (CalibrateError, ConfigError))


def _main(argv: list[str]) -> int:
    settings = parse_args(argv)
    settings = replace(settings, output=str(settings.output_path()))  # one time stamp
    if settings.nproc > 0:
        run_local(settings)
    else:
        run_in_allocation(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
