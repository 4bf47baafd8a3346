"""z traffic per optimizer step (ours vs. AxoNN's) and the memory of the ORS buffers.

    python bench/bench_ztraffic.py      # writes bench/results/bench_ztraffic.md

1. Bytes one GPU sends over z per optimizer step for the Linear weights of every block:
   the all-gathers and reduce-scatters of ``traffic.block_collectives`` (the list the
   step-time model prices), each (p-1)/p of its full size on a ring, times the
   micro-steps per step. Against AxoNN's own model (Megatron-AxoNN's comm_model.py,
   axonn.md §4.1, depth term): 3 collectives (forward gather, recompute gather,
   reduce-scatter) x bf16 x (Gd-1)/Gd x K*H^2/(Gc*Gr) per Linear type (K = 3, 1, 4, 4),
   x grad_acc, x layers. Grids: the planner's best (with its weight-caching choice) for
   gpt_20b on 1,024 Perlmutter GPUs and gpt_320b on 32,768 Frontier GCDs (the headline
   case, bench/headline_plans.py). Target: ours in bf16 <= 1.05 x AxoNN.
2. Memory of the weight-gradient (reduce-scatter) buffers of the headline models on each
   machine's headline grid: the ORS window of 2 blocks in bf16 (now), every block pending
   in bf16, and every block pending in fp32 (before the window and the bf16 wire).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig, WireConfig
from axonn_launch.common.traffic import ALL_GATHER, REDUCE_SCATTER, block_collectives, wire_bytes
from axonn_launch.config.compose import load
from axonn_launch.cost.memory import (
    GIB,
    estimate_memory,
    largest_cache_that_fits,
    reduce_scatter_buffers,
)
from axonn_launch.cost.planner import best_grid

RESULTS = Path(__file__).parent / "results" / "bench_ztraffic.md"
TARGET = 1.05
BF16 = 2
FP32_WIRE = WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32")
TRAFFIC_RUNS = [  # model, machine, nodes, global batch (sequences of 2048 tokens)
    ("gpt_20b", "perlmutter", 256, 1024),
    ("gpt_320b", "frontier", 4096, 32768),
]
MEMORY_RUNS = [  # machine, nodes, global batch: the headline cases (1 sequence per GPU)
    ("perlmutter", 1024, 4096),
    ("frontier", 4096, 32768),
    ("alps", 1536, 6144),
]
HEADLINE_MODELS = ("gpt_80b", "gpt_320b", "gpt_640b")


def planned(model_name: str, machine_name: str, nodes: int, global_batch: int):
    """(config, the planner's best row with an automatic cache, its train config)."""
    cfg = load([f"machine={machine_name}", f"model={model_name}", "train.seq_len=2048",
                f"train.global_batch={global_batch}"])  # fmt: skip
    auto = dataclasses.replace(cfg.train, cache_layers=None)
    row = best_grid(machine=cfg.machine, model=cfg.model, train=auto, nodes=nodes)
    train = dataclasses.replace(auto, micro_batch=row.micro_batch, cache_layers=row.cache_layers)
    return cfg, row, train


# --------------------------------------------------------------------------- z traffic


def our_z_bytes(model: ModelSpec, grid: Grid, train: TrainConfig) -> float:
    """Bytes per GPU per step of the blocks' weight all-gathers and reduce-scatters."""
    ring = (grid.z - 1) / grid.z
    cached = min(train.cache_layers or 0, model.n_layer) if grid.z > 1 else 0
    per_micro = 0.0
    for count, is_cached in ((model.n_layer - cached, False), (cached, True)):
        colls = block_collectives(model, grid, train, on_gpu=True, cached=is_cached)
        z = sum(c.nbytes for c in colls if c.op in (ALL_GATHER, REDUCE_SCATTER))
        per_micro += count * ring * z
    return per_micro * train.accumulation_steps(grid)


def axonn_z_bytes(model: ModelSpec, grid: Grid, train: TrainConfig) -> float:
    """AxoNN's depth term (axonn.md §4.1), in bytes: for each Linear type K in (3, 1, 4,
    4), 3/2 * 2 * (Gd-1)/Gd * K*H^2/(Gc*Gr) * 2 * grad_acc, summed, times the layers."""
    h, gd, gc, gr = model.d_model, grid.z, grid.x, grid.y
    grad_acc = train.accumulation_steps(grid)
    per_type = [3 / 2 * 2 * (gd - 1) / gd * k * h * h / (gc * gr) * 2 * grad_acc
                for k in (3, 1, 4, 4)]  # fmt: skip
    return model.n_layer * sum(per_type)


def traffic_lines() -> list[str]:
    lines = [
        "## z traffic per optimizer step: ours vs. AxoNN's model",
        "",
        "GB one GPU sends over z per optimizer step for the blocks' Linear weights (ring: "
        "(z-1)/z of each collective's full size). AxoNN = Megatron-AxoNN's depth term "
        "(axonn.md §4.1): 3 collectives (forward gather, recompute gather, "
        "reduce-scatter) in bf16. Ours: forward gather, recompute gather (kept for the "
        "backward that follows it) and reduce-scatter per uncached block, forward gather "
        "and reduce-scatter per cached one (`traffic.block_collectives`). 'planner's cache' = "
        "the blocks the planner chose for this grid (`train.cache_layers` automatic); "
        "'all cached' = every block, with whether that would fit in memory.",
        "",
        "| model | machine, GPUs | grid (data,x,y,z) | mb | micro-steps | ours fp32, no cache "
        "(before) | ours bf16, no cache | ours bf16, planner's cache | ours bf16, all cached "
        "| AxoNN (bf16) | ratio ours bf16 (planner's cache) / AxoNN | target <= 1.05 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model_name, machine_name, nodes, batch in TRAFFIC_RUNS:
        cfg, row, train = planned(model_name, machine_name, nodes, batch)
        model, grid, hw = cfg.model, row.grid, cfg.machine.hardware
        variants = {
            "fp32": dataclasses.replace(train, wire=FP32_WIRE, cache_layers=0),
            "bf16": dataclasses.replace(train, cache_layers=0),
            "planned": train,
            "all": dataclasses.replace(train, cache_layers=model.n_layer),
        }
        gb = {k: our_z_bytes(model, grid, tr) / 1e9 for k, tr in variants.items()}
        axonn = axonn_z_bytes(model, grid, train) / 1e9
        all_fit = estimate_memory(model=model, grid=grid, train=variants["all"]).fits(
            hw.mem_per_gpu_gb
        )
        ratio = gb["planned"] / axonn
        g = grid
        lines.append(
            f"| {model_name} | {machine_name}, {nodes * hw.gpus_per_node} | "
            f"({g.data},{g.x},{g.y},{g.z}) | {row.micro_batch} | "
            f"{train.accumulation_steps(grid)} | {gb['fp32']:.1f} | {gb['bf16']:.1f} | "
            f"{gb['planned']:.1f} ({row.cache_layers} of {model.n_layer} blocks) | "
            f"{gb['all']:.1f} ({'fits' if all_fit else 'does not fit'}) | {axonn:.1f} | "
            f"{ratio:.2f} | {'met' if ratio <= TARGET else 'missed'} |"
        )
        lines.append(_cache_needed(model, grid, train, hw.mem_per_gpu_gb, axonn))
    lines += [
        "",
        "Per block and micro-step with activation checkpointing, ours sends 3 weight "
        "collectives, AxoNN's count: the recomputed forward keeps its gathered weights for "
        "the backward that follows it (one block held at a time, in memory.py's weight "
        "cache term), as AxoNN's default keeps the gathered block. A cached block sends 2 "
        "(its forward gather serves the recompute and the backward). So ours in bf16 is at "
        "most AxoNN's volume on every grid, and below it by the blocks the planner caches. "
        "An earlier version of the core re-gathered in the backward (4 collectives, 4/3 of "
        "AxoNN's): the 'fp32, no cache (before)' column is today's count in fp32.",
        "",
    ]
    return lines


def _cache_needed(model, grid, train, mem_gb: float, axonn_gb: float) -> str:
    """A line: the fewest cached blocks that meet the target, and the most that fit."""
    need = next((n for n in range(model.n_layer + 1)
                 if our_z_bytes(model, grid, dataclasses.replace(train, cache_layers=n)) / 1e9
                 <= TARGET * axonn_gb), None)  # fmt: skip
    most = largest_cache_that_fits(model, grid, dataclasses.replace(train, cache_layers=0), mem_gb)
    return (
        f"| | | | | | | | | | | blocks to cache for <= {TARGET}: {need}; most that fit: {most} | |"
    )


# --------------------------------------------------------------------------- ORS memory


def memory_lines() -> list[str]:
    lines = [
        "## Memory of the weight-gradient (reduce-scatter) buffers",
        "",
        "GiB per GPU of the dW blocks alive for their reduce-scatter over z (memory.py, "
        "'reduce-scatter buffers'), on the planner's best grid of each headline case (1 "
        "sequence per GPU, as in bench/headline_plans.py, automatic cache). 'window 2, "
        "bf16' is what the core does now (`train.ors_window=2`, `train.wire=auto`); "
        "'every block, bf16' is `train.ors_window=0`; 'every block, fp32' is the core "
        "before the window and the bf16 wire. 'total' = the whole estimate with those "
        "buffers.",
        "",
        "| machine | model | grid (data,x,y,z) | GPU GiB | window 2, bf16 | every block, "
        "bf16 | every block, fp32 | total now | total, every block fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for machine_name, nodes, batch in MEMORY_RUNS:
        for model_name in HEADLINE_MODELS:
            cfg, row, train = planned(model_name, machine_name, nodes, batch)
            model, grid = cfg.model, row.grid
            cases = [train, dataclasses.replace(train, ors_window=0),
                     dataclasses.replace(train, ors_window=0, wire=FP32_WIRE)]  # fmt: skip
            buffers = [reduce_scatter_buffers(model, grid, tr, wire_bytes(tr, on_gpu=True))
                       for tr in cases]  # fmt: skip
            totals = [estimate_memory(model=model, grid=grid, train=tr).total for tr in cases]
            g = grid
            lines.append(
                f"| {machine_name} | {model_name} | ({g.data},{g.x},{g.y},{g.z}) | "
                f"{cfg.machine.hardware.mem_per_gpu_gb:g} | "
                + " | ".join(f"{b / GIB:.2f}" for b in buffers)
                + f" | {totals[0] / GIB:.1f} | {totals[2] / GIB:.1f} |"
            )
    return lines


def main() -> None:
    lines = [
        "# z traffic and ORS buffer memory",
        "",
        "`python bench/bench_ztraffic.py` (pure computation from the models, no measurement).",
        "",
        *traffic_lines(),
        *memory_lines(),
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
