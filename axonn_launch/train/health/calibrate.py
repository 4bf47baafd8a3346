"""Calibrate's measurements: the torch half of ``python -m axonn_launch.calibrate``.

The command (``axonn_launch/calibrate.py``) decides, torch-free, what to measure and how
to read it (a ``Plan``); this module joins the world (srun's tasks, or ``nproc`` local gloo
processes) and times collectives, GEMMs, element-wise adds and overlap on every rank at
once. Every timing is the slowest rank's in each repetition, then the best of ``reps``
repetitions (``_best_seconds``).

What each measurement is: ``docs/cost-model.md`` ("train/health/calibrate.py").
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from axonn_launch.common.spec import RuntimeConfig
from axonn_launch.common.traffic import ALL_GATHER, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER
from axonn_launch.train.parallel import gemm as formulations
from axonn_launch.train.parallel.bootstrap import DistEnv, discover_env, init_distributed
from axonn_launch.train.parallel.timing import elapsed

GPU_GEMM_SIZES = (1024, 2048, 4096, 8192)
CPU_GEMM_SIZES = (64, 128, 256, 512)
GPU_ADD_ELEMENTS = (1 << 18, 1 << 22, 1 << 26)
CPU_ADD_ELEMENTS = (1 << 14, 1 << 17, 1 << 20)


class Settings(Protocol):
    """The command's settings this half reads (``axonn_launch.calibrate.Settings``)."""

    machine: str
    model: str
    small_bytes: int
    large_bytes: int
    reps: int
    warmup: int
    block_seconds: float


class Layout(Protocol):
    """``size`` ranks ``stride`` apart, ``per_node`` of them on one node."""

    size: int
    stride: int
    per_node: int

    def groups(self, world: int) -> list[list[int]]: ...


class Gemm(Protocol):
    """One GEMM shape of the training core (``cost.perf.Gemm``)."""

    op: str
    linear: str
    m: int
    n: int
    k: int
    flops: float


class Plan(Protocol):
    """What to measure and how to read it, decided torch-free by the command
    (``axonn_launch.calibrate.Plan``); picklable, so that spawned processes get it."""

    settings: Settings
    gpus_per_node: int

    def layouts(self, world: int) -> Sequence[Layout]: ...

    def gemm_shapes(self, world: int) -> tuple[Sequence[Gemm], str]: ...

    def fit(
        self, collective: str, p: int, sizes: tuple[float, ...], times: tuple[float, ...]
    ) -> tuple[float, float]: ...

    def finish(self, result: dict[str, Any] | None) -> None: ...


# --------------------------------------------------------------------------- joining a world


def join(runtime: RuntimeConfig) -> DistEnv:
    """This task's place in the allocation (srun / torchrun / mpirun variables)."""
    return discover_env(runtime)


def world_problem(env: DistEnv) -> str | None:
    """Why this task cannot calibrate its machine: nccl asked for where it (or a GPU) is
    missing; None when it can. (A process that no launcher started is turned away before
    torch is imported: ``axonn_launch/calibrate.py``'s ``outside_a_task``.)"""
    if env.backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        return (
            f"backend nccl is not available here (torch {torch.__version__},"
            f" {torch.cuda.device_count()} GPUs visible)"
        )
    return None


def measure_in_world(env: DistEnv, plan: Plan) -> None:
    """Join the job's world as ``env`` says and measure; rank 0 hands the result on."""
    init_distributed(env)
    try:
        plan.finish(measure(plan))
    finally:
        dist.destroy_process_group()


def spawn_local(plan: Plan, nproc: int, port: int) -> None:
    """``nproc`` gloo processes on this computer (one "node"), each measuring."""
    import torch.multiprocessing as mp

    mp.spawn(_local_worker, args=(plan, nproc, port), nprocs=nproc, join=True)


def _local_worker(rank: int, plan: Plan, nproc: int, port: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc
    )
    try:
        plan.finish(measure(plan))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- measuring


def measure(plan: Plan) -> dict[str, Any] | None:
    """Run every measurement on this rank of an initialized world; rank 0 gets the result."""
    settings, gpus_per_node = plan.settings, plan.gpus_per_node

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _current_device()
    large = settings.large_bytes or (64 << 20 if device.type == "cuda" else 4 << 20)
    sizes = (settings.small_bytes, large // 8, large)
    phase = Phases(rank)
    results = measure_collectives(plan, phase, device, sizes)
    phase("GEMM throughput")
    gemm = measure_gemm(device, settings)
    shapes, planned = plan.gemm_shapes(world)
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


def measure_collectives(
    plan: Plan, phase: Phases, device: torch.device, sizes: tuple[int, int, int]
) -> list[dict[str, Any]]:
    """Every collective in every group layout of the plan at ``sizes``, with its fit."""
    settings = plan.settings
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    todo = plan.layouts(world)
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
            bus, alpha = plan.fit(collective, layout.size, sizes, times)
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
    return results


class Phases:
    """Rank 0 says what it measures now, with the seconds since the start (also in logs)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.start = rank, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.rank == 0:
            print(f"calibrate [{time.perf_counter() - self.start:6.1f} s] {text}", flush=True)


def _current_device():

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _own_group(layout: Layout, world: int, rank: int):
    """Create every group of the layout (collective over the world); return this rank's."""

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


def measure_gemm_shapes(shapes: list[Gemm], device, settings: Settings) -> list[dict[str, Any]]:
    """TFLOP/s of every distinct formulation (``train/parallel/gemm.py``) of each GEMM shape, on
    operands laid out as the training core passes them (``gemm_operands``); the slowest
    rank's time per formulation, all ranks timing at once. Without the tuner module only
    the plain ``a @ b`` ("direct") is timed."""

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

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if g.op == "fwd":
        return rand(g.m, g.k), rand(g.n, g.k).t()
    if g.op == "dx":
        return rand(g.m, g.k), rand(g.k, g.n)
    return rand(g.k, g.m).t(), rand(g.k, g.n)


def _time_layouts(a, b, settings: Settings) -> dict[str, float]:
    """Seconds per call of each distinct formulation of a @ b (``parallel/formulations.py``)."""
    names = formulations.distinct_formulations(a, b)
    if 2 * a.shape[0] * a.shape[1] * b.shape[1] < formulations.MIN_FLOPS:
        names = [formulations.DIRECT.name]  # the job's tuner leaves GEMMs this small as they are
    return formulations.time_formulations(a, b, settings.reps, warmup=settings.warmup, names=names)


def _slowest(seconds: dict[str, float], device) -> dict[str, float]:
    """Per name, the largest value over the ranks (every rank passes the same names)."""

    names = sorted(seconds)
    t = torch.tensor([seconds[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist(), strict=True))


def measure_elementwise(device, settings: Settings) -> list[list[float]]:
    """[(bytes per kernel, GB/s)] of an element-wise add (two reads, one write) at a few
    sizes, on every rank at once (ranks on one node share its memory bandwidth)."""

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

    for _ in range(settings.warmup):
        kernel()
    one = max(elapsed(kernel, device), 1e-7)
    calls = torch.tensor([max(2, min(100_000, int(settings.block_seconds / one) + 1))])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    return int(calls.item())
