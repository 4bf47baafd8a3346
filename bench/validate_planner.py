"""Does the planner rank grids the way they really run? Measured on local gloo processes.

    python bench/validate_planner.py [steps=5] [warmup=2] [reuse_calibration=1]

Writes bench/results/validate_planner.md.

1. Calibrate with 4 local gloo processes (``axonn_launch.calibrate``): collective
   bandwidth/latency per group layout and GEMM speed. A second calibration with 8
   processes is taken too, because 8 processes on this computer's cores share them
   differently; the 8-rank predictions are shown with both.
2. For every 4-rank and 8-rank grid valid for a small GPT, predict the step time
   (``perf.step_time`` with the calibration; micro-batch chosen as ``plan`` does) and
   measure it: forward + backward of every micro-step and ``finish_gradients`` (the
   optimizer update, which the model leaves out, is not timed), slowest rank, best and
   median over ``steps`` rounds after ``warmup`` rounds; a round times one step of
   every grid.
3. Report Spearman's rank correlation between predicted and measured (best-of) times,
   and whether the predicted best grid is among the 3 fastest measured; the same against
   the medians.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.calibrate import Settings, run_local
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.cost.perf import Calibration, load_calibration, step_time
from axonn_launch.cost.planner import rank_grids

RESULTS = Path(__file__).parent / "results"
MODEL = ModelSpec("gpt_validate", n_layer=2, d_model=256, n_head=8, vocab_size=512, max_seq_len=128)
TRAIN = TrainConfig(global_batch=16, micro_batch=16, seq_len=128, dtype="fp32",
                    overlap=OverlapConfig())  # fmt: skip
WORLDS = (4, 8)


def local_hardware(world: int) -> Hardware:
    """All processes on one "node"; every number comes from the calibration."""
    return Hardware(gpus_per_node=world, gpu_model="cpu", latency_us=50, intra_node_gbps=1,
                    inter_node_gbps=1)  # fmt: skip


def planned(world: int, cal: Calibration) -> list[tuple[Grid, int, float]]:
    """(grid, micro-batch, predicted seconds) for every runnable grid, as plan ranks them."""
    ranking = rank_grids(
        hardware=local_hardware(world), model=MODEL, train=TRAIN, world_size=world, calibration=cal
    )
    return [(r.grid, r.micro_batch, r.step_time_s) for r in ranking.rows]


def predict(world: int, grid: Grid, micro: int, cal: Calibration) -> float:
    train = dataclasses.replace(TRAIN, micro_batch=micro)
    return step_time(
        hardware=local_hardware(world), model=MODEL, train=train, grid=grid, calibration=cal
    ).total


# --------------------------------------------------------------------------- measuring


def measure_world(
    world: int, configs: list[tuple[Grid, int]], steps: int, warmup: int
) -> list[tuple[float, float]]:
    """Spawn ``world`` gloo processes once and time every (grid, micro-batch) in turn:
    (best, median) seconds per grid."""
    import torch.multiprocessing as mp

    out = RESULTS / f".measured-{world}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    payload = [(g.as_dict(), m) for g, m in configs]
    mp.spawn(_worker, args=(world, port, payload, steps, warmup, str(out)), nprocs=world, join=True)
    times = json.loads(out.read_text())
    out.unlink()
    return [(best, median) for best, median in times]


def _worker(rank: int, world: int, port: int, payload, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        runs = [_GridRun(Grid(**g), micro, rank) for g, micro in payload]
        samples: list[list[float]] = [[] for _ in runs]
        # Round-robin over the grids, so that whatever else runs on the computer slows
        # them all alike instead of whichever happened to be measured at that moment.
        for round_ in range(warmup + steps):
            for run, times in zip(runs, samples, strict=True):
                elapsed = run.step()
                if round_ >= warmup:
                    times.append(elapsed)
        if rank == 0:
            stats = [(min(t), statistics.median(t)) for t in samples]
            Path(out).write_text(json.dumps(stats))
    finally:
        dist.destroy_process_group()


class _GridRun:
    """One grid's model and batches on this rank; ``step()`` times one optimizer step."""

    def __init__(self, grid: Grid, micro: int, rank: int) -> None:
        import torch

        from axonn_launch.train.models.gpt import GPT
        from axonn_launch.train.parallel.groups import build_groups

        train = dataclasses.replace(TRAIN, micro_batch=micro)
        self.groups = build_groups(grid, rank=rank)
        self.model = GPT(MODEL, groups=self.groups, overlap=train.overlap, seed=0, device="cpu")
        coords = grid.coords(rank)
        self.accumulation = train.accumulation_steps(grid)
        gen = torch.Generator().manual_seed(1000 * coords.data + coords.z)  # same in a plane
        shape = (micro // grid.z, train.seq_len + 1)
        self.batches = [
            torch.randint(0, MODEL.vocab_size, shape, generator=gen)
            for _ in range(self.accumulation)
        ]

    def step(self) -> float:
        """Seconds of forward + backward of every micro-step + finish_gradients, slowest rank."""
        import torch
        import torch.distributed as dist

        from axonn_launch.train.models.gpt import finish_gradients

        dist.barrier()
        start = time.perf_counter()
        for tokens in self.batches:
            loss = self.model(tokens[:, :-1], tokens[:, 1:]) / self.accumulation
            loss.backward()
        finish_gradients(self.model, self.groups)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.model.zero_grad(set_to_none=True)
        return float(elapsed.item())


# --------------------------------------------------------------------------- statistics


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


# --------------------------------------------------------------------------- report


def calibrate(nproc: int, reuse: bool) -> tuple[Calibration, Path]:
    path = RESULTS / f"calibration-local-{nproc}.json"
    if not (reuse and path.is_file()):
        run_local(Settings(machine="local", output=str(path), nproc=nproc, reps=10))
    return load_calibration(path), path


def section(world: int, rows, cals: dict[str, Calibration]) -> tuple[list[str], dict]:
    """Markdown for one world size; rows are (grid, micro-batch, (best, median) seconds)."""
    grids = [g for g, _, _ in rows]
    best_t = [t[0] for *_, t in rows]
    median_t = [t[1] for *_, t in rows]
    names = list(cals)
    preds = {n: [predict(world, g, m, cals[n]) for g, m, _ in rows] for n in names}
    lines = [
        f"## {world}-rank grids ({len(rows)} runnable)",
        "",
        "| grid (data,x,y,z) | mb | measured best (s) | measured median (s) | measured rank | "
        + " | ".join(f"predicted, {n} (s) | predicted rank, {n}" for n in names)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(names),
    ]
    m_rank = ranks(best_t)
    p_ranks = {n: ranks(preds[n]) for n in names}
    for i, (g, mb, _) in enumerate(rows):
        cells = " | ".join(f"{preds[n][i]:.3f} | {p_ranks[n][i]:g}" for n in names)
        lines.append(
            f"| ({g.data},{g.x},{g.y},{g.z}) | {mb} | {best_t[i]:.3f} | {median_t[i]:.3f} | "
            f"{m_rank[i]:g} | {cells} |"
        )
    summary: dict[str, dict] = {}
    lines.append("")
    for n in names:
        predicted_best = grids[min(range(len(rows)), key=lambda i: preds[n][i])]
        summary[n] = {"predicted_best": predicted_best.describe()}
        for label, measured in (("best", best_t), ("median", median_t)):
            order = sorted(range(len(rows)), key=lambda i: measured[i])
            rho = spearman(preds[n], measured)
            inside = predicted_best in {grids[i] for i in order[:3]}
            regret = measured[grids.index(predicted_best)] / measured[order[0]] - 1
            fastest_rank = p_ranks[n][order[0]]
            summary[n][label] = {"spearman": rho, "in_top3": inside, "regret": regret}
            lines.append(
                f"- {n}, measured {label}: Spearman rank correlation {rho:.2f}; predicted best "
                f"{predicted_best.describe()} is {'inside' if inside else 'outside'} the "
                f"measured top 3 and {100 * regret:.0f}% slower than the measured fastest "
                f"({grids[order[0]].describe()}, predicted rank {fastest_rank:g})."
            )
    return lines + [""], summary


def main(argv: list[str]) -> None:
    opts = dict(a.split("=", 1) for a in argv)
    steps, warmup = int(opts.get("steps", 5)), int(opts.get("warmup", 2))
    reuse = opts.get("reuse_calibration", "0") == "1"
    RESULTS.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()[0]
    cal4, path4 = calibrate(4, reuse)
    cal8, path8 = calibrate(8, reuse)
    sections, summaries = [], {}
    for world in WORLDS:
        plan_rows = planned(world, cal4)
        configs = [(g, m) for g, m, _ in plan_rows]
        measured = measure_world(world, configs, steps, warmup)
        rows = [(g, m, t) for (g, m), t in zip(configs, measured, strict=True)]
        cals = {"4-process calibration": cal4}
        if world == 8:
            cals["8-process calibration"] = cal8
        lines, summaries[world] = section(world, rows, cals)
        sections += lines
    header = [
        "# Planner validation on local processes",
        "",
        f"`python bench/validate_planner.py steps={steps} warmup={warmup}` on this computer "
        f"({platform.machine()}, {os.cpu_count()} cores, torch gloo, fp32, one thread per "
        f"process), {time.time() - started:.0f} s in all; load average {load_before:.1f} "
        f"before, {os.getloadavg()[0]:.1f} after (other programs share the cores).",
        "",
        f"Model: {MODEL.name}, {MODEL.n_layer} layers, d_model {MODEL.d_model}, "
        f"{MODEL.n_head} heads, vocab {MODEL.vocab_size}; sequence {TRAIN.seq_len}, global "
        f"batch {TRAIN.global_batch} sequences, all three overlaps on, no activation "
        "checkpointing. Micro-batch per grid as `plan` picks it (the largest valid one; "
        "memory is unbounded here). Step = forward + backward of each micro-step + "
        f"`finish_gradients`, slowest rank; best and median of {steps} rounds after "
        f"{warmup} warm-up rounds, each round timing one step of every grid in turn (so that "
        "load from other programs spreads over all grids). Ranks and the top 3 use the best "
        "times; calibration timings are best-of too.",
        "",
        f"Calibrations: `{path4.relative_to(RESULTS.parent.parent)}`, "
        f"`{path8.relative_to(RESULTS.parent.parent)}`.",
        "",
        "On this computer the processes share few cores, so 'bandwidth' and 'GEMM speed' are "
        "those of oversubscribed processes, and the absolute predictions move with the load "
        "at calibration time; the question is whether the model, fed with numbers measured "
        "the same way, orders the grids as they really run. Calibration times GEMMs in "
        "blocks with every rank computing at once, and measures the overlap efficiency "
        f"(4 processes: {cal4.overlap_efficiency:.2f}, 8 processes: "
        f"{cal8.overlap_efficiency:.2f}): gloo's communication needs the same cores as the "
        "GEMMs, so overlap hides little here, unlike on GPUs. The model leaves out "
        "per-operator dispatch and times every GEMM at the speed of square ones, which is "
        "why its absolute times are below the measured ones.",
        "",
    ]
    (RESULTS / "validate_planner.md").write_text("\n".join(header + sections))
    print("\n".join(header + sections))
    print(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
