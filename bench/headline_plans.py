"""The planner's choice for the AxoNN Gordon Bell headline runs, beside the reported numbers.

    python bench/headline_plans.py      # writes bench/results/headline_plans.md

Reported (arXiv 2502.08145, axonn.md §5.2): Perlmutter 620.1 PF/s (4,096 A100s is an
inference), Frontier 1.381 EF/s on 32,768 MI250X GCDs, Alps 1.423 EF/s on 6,144 GH200s.
Neither the models nor the batch sizes of those runs are in the readable sources, so each
machine is planned for a few presets and global batches; the assumptions are printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.config import load
from axonn_launch.perf import (
    COLLECTIVES,
    DEFAULT_GEMM_EFFICIENCY,
    DEFAULT_KERNEL_OVERHEAD_US,
    BandwidthSample,
    Calibration,
)
from axonn_launch.plan import best_grid

RESULTS = Path(__file__).parent / "results" / "headline_plans.md"
RUNS = [  # machine, nodes, reported PF/s
    ("perlmutter", 1024, 620.1),
    ("frontier", 4096, 1381.0),
    ("alps", 1536, 1423.0),
]
MODELS = ("gpt_80b", "gpt_320b", "gpt_640b")
SEQUENCES_PER_GPU = (0.5, 1)  # global batch = this * GPUs (sequences of 2048 tokens)

# Bus bandwidths (GB/s) measured by AxoNN and hard-coded in Megatron-AxoNN's
# comm_model.py (axonn.md §4.2), by ip (product of the sizes of the axes inside this one)
# and my (this axis's size); the last row / column stands for everything beyond.
AXONN_TABLES = {
    "perlmutter": {1: (76, 225, 80, 80), 2: (76, 40, 40, 40), 4: (20, 20, 20, 20)},
    "frontier": {
        1: (129, 52, 135, 40),
        2: (50, 72, 20, 20),
        4: (36, 10, 10, 10),
        8: (5, 5, 5, 5),
    },  # fmt: skip
}


def axonn_calibration(machine_name: str, gpus_per_node: int, latency_us: float) -> Calibration:
    """The AxoNN table as a Calibration: one sample per (group size, ranks per node)."""
    table = AXONN_TABLES[machine_name]
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


def plan_row(
    machine_name: str, nodes: int, model_name: str, global_batch: int, cal: Calibration, ors: bool
):
    overrides = [f"machine={machine_name}", f"model={model_name}", "train.seq_len=2048"]
    overrides += [f"train.global_batch={global_batch}", f"train.overlap.reduce_scatter={ors}"]
    cfg = load(overrides)
    machine, model, train = cfg.machine, cfg.model, cfg.train
    try:
        row = best_grid(machine=machine, model=model, train=train, nodes=nodes, calibration=cal)
    except ValueError as exc:
        return None, str(exc)
    world = nodes * machine.hardware.gpus_per_node
    return row, world * row.tflops_per_gpu / 1000  # PF/s


def main() -> None:
    lines = [
        "# Planned headline runs vs. the AxoNN Gordon Bell numbers",
        "",
        "`python bench/headline_plans.py`. For each machine, node count and model, the "
        "planner's best grid (`best_grid`) and its predicted whole-machine model FLOP/s "
        "(Narayanan's count with full activation recompute, as Megatron-AxoNN counts).",
        "",
        "Assumptions:",
        "",
        "- hardware numbers from `axonn_launch/conf/machine/*.yaml` (peak bf16, per-GPU "
        "intra-node and inter-node bandwidth, latency, HBM bandwidth for the element-wise "
        "kernels); no calibration file measured on the machines; full overlap;",
        f"- GEMMs at {DEFAULT_GEMM_EFFICIENCY:.0%} of peak plus {DEFAULT_KERNEL_OVERHEAD_US:g} us "
        "per call;",
        "- sequence length 2048, full activation checkpointing, OAR and OAG on (ORS as "
        "marked), the training core's dtypes on the wire (bf16 forward all-reduces; fp32 "
        "backward all-reduces, weights and gradients);",
        "- global batch = GPUs x the factor shown (sequences); the paper's batch sizes and "
        "models for these runs are not in the readable sources;",
        "- Perlmutter: 4,096 A100-40GB (the GPU count is an inference, axonn.md §5.2);",
        "- ORS as the training core implements it keeps every layer's full fp32 weight "
        "gradient block alive until the end of the backward (memory.py, 'reduce-scatter "
        "buffers'), which pushes large models to large x*y; the rows marked 'off' plan the "
        "same run with `train.overlap.reduce_scatter=false`;",
        "- bandwidths: 'yaml' = the machine profile's nominal per-GPU intra-node and "
        "inter-node numbers; 'AxoNN' = the bus bandwidths AxoNN measured on Perlmutter and "
        "Frontier (Megatron-AxoNN's comm_model.py, axonn.md §4.2), by group size and ranks "
        "per node, with the profile's latency.",
        "",
        "| machine | GPUs | reported | model | global batch | ORS | bandwidths | best grid "
        "(data,x,y,z) | mb | step (s) | predicted | % of peak | predicted / reported |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for machine_name, nodes, reported in RUNS:
        hw = load([f"machine={machine_name}"]).machine.hardware
        world = nodes * hw.gpus_per_node
        cals = {"yaml": Calibration()}
        if machine_name in AXONN_TABLES:
            cals["AxoNN"] = axonn_calibration(machine_name, hw.gpus_per_node, hw.latency_us)
        cases = [("yaml", m, f, True) for m in MODELS for f in SEQUENCES_PER_GPU]
        cases += [("yaml", m, SEQUENCES_PER_GPU[-1], False) for m in MODELS]
        if "AxoNN" in cals:
            cases += [("AxoNN", m, SEQUENCES_PER_GPU[-1], o) for o in (True, False) for m in MODELS]
        for source, model_name, per_gpu, ors in cases:
            batch = int(world * per_gpu)
            row, pflops = plan_row(machine_name, nodes, model_name, batch, cals[source], ors)
            head = (
                f"| {machine_name} | {world} | {_flops(reported)} | {model_name} | {batch} | "
                f"{'on' if ors else 'off'} | {source} |"
            )
            if row is None:
                lines.append(head + f" none: {pflops} | | | | | |")
                continue
            g = row.grid
            lines.append(
                head + f" ({g.data},{g.x},{g.y},{g.z}) | {row.micro_batch} | "
                f"{row.step_time_s:.2f} | {_flops(pflops)} | "
                f"{100 * row.fraction_of_peak:.1f} | {pflops / reported:.2f} |"
            )
    lines += [
        "",
        "Reported % of peak (computed in axonn.md §5.2): Perlmutter 48.5%, Frontier 22.0%, "
        "Alps 23.4%. Predictions above the report show what the model leaves out: every GEMM "
        "is assumed to run at the same fraction of peak, with no term for the "
        "layout-dependent GEMM speed the paper tuned on Frontier or for the GH200 power cap. "
        "Nominal bandwidths ('yaml') are optimistic for Frontier next to AxoNN's "
        "measurements. A calibration file measured on the machine "
        "(`python -m axonn_launch.calibrate`) replaces the assumed GEMM efficiency and "
        "bandwidths.",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _flops(pflops: float) -> str:
    return f"{pflops / 1000:.3f} EF/s" if pflops >= 1000 else f"{pflops:.1f} PF/s"


if __name__ == "__main__":
    main()
