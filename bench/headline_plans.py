"""The planner's choice for AxoNN's published runs, beside the reported numbers.

    python bench/headline_plans.py
        # writes bench/results/headline_plans.md and bench/results/validation_80b.md

Gordon Bell headline runs (arXiv 2502.08145, axonn.md §5.2): Perlmutter 620.1 PF/s
(4,096 A100s is an inference), Frontier 1.381 EF/s on 32,768 MI250X GCDs, Alps 1.423
EF/s on 6,144 GH200s. Neither their models nor their batch sizes are in the readable
sources, so each machine is planned for a few presets and global batches.

The validation point (arXiv 2305.13525, axonn.md §5.2): an 80B GPT (§5.3 shape) on
1,024 Perlmutter A100-40GB GPUs at 182 PF/s, 57% of peak. Its batch is not in the
readable sources either; the planner is asked for global batch 1024. The file shows the
prediction, the grid, the step's breakdown and what each modelled change of the
training core contributes (one change at a time, nothing fitted).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.calibrate import AXONN_BUS_GBPS, published_calibration
from axonn_launch.common.spec import WireConfig
from axonn_launch.config.compose import load
from axonn_launch.cost.perf import DEFAULT_GEMM_EFFICIENCY, DEFAULT_KERNEL_OVERHEAD_US, Calibration
from axonn_launch.cost.planner import PlanRow, best_grid

RESULTS = Path(__file__).parent / "results"
RUNS = [  # machine, nodes, reported PF/s
    ("perlmutter", 1024, 620.1),
    ("frontier", 4096, 1381.0),
    ("alps", 1536, 1423.0),
]
MODELS = ("gpt_80b", "gpt_320b", "gpt_640b")
SEQUENCES_PER_GPU = (0.5, 1)  # global batch = this * GPUs (sequences of 2048 tokens)
AUTO = None  # train.cache_layers: the planner chooses per grid
FP32_WIRE = WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32")

VALIDATION = dict(machine="perlmutter", model="gpt_80b", nodes=256, global_batch=1024)
PUBLISHED_FRACTION = 0.57
VALIDATION_COMMAND = (
    "python -m axonn_launch.plan machine=perlmutter model=gpt_80b nodes=256 train.global_batch=1024"
)


def calibrations(machine_name: str) -> dict[str, Calibration]:
    """'profile': the machine profile's nominal bandwidths; 'AxoNN': AxoNN's measured ones."""
    hw = load([f"machine={machine_name}"]).machine.hardware
    cals = {"profile": Calibration()}
    if machine_name in AXONN_BUS_GBPS:
        cals["AxoNN"] = published_calibration(machine_name, hw.gpus_per_node, hw.latency_us)
    return cals


def best(machine_name, nodes, model_name, global_batch, cal, **train_changes) -> PlanRow | str:
    """The planner's best row, or why there is none."""
    overrides = [f"machine={machine_name}", f"model={model_name}", "train.seq_len=2048"]
    cfg = load([*overrides, f"train.global_batch={global_batch}"])
    train = dataclasses.replace(cfg.train, **train_changes)
    try:
        return best_grid(machine=cfg.machine, model=cfg.model, train=train, nodes=nodes,
                         calibration=cal)  # fmt: skip
    except ValueError as exc:
        return str(exc)


def grid_text(row: PlanRow) -> str:
    g = row.grid
    return f"({g.data},{g.x},{g.y},{g.z})"


def flops_text(pflops: float) -> str:
    return f"{pflops / 1000:.3f} EF/s" if pflops >= 1000 else f"{pflops:.1f} PF/s"


def comm_text(row: PlanRow) -> str:
    return ", ".join(f"{a} {t:.2f}" for a, t in row.comm_s.items() if t >= 0.005) or "-"


# --------------------------------------------------------------------------- headline table


def headline_cases(machine_name: str, cals: dict[str, Calibration]):
    """(bandwidths, model, sequences per GPU, cache_layers) rows to plan."""
    cases = [("profile", m, f, 0) for m in MODELS for f in SEQUENCES_PER_GPU]
    cases += [("profile", m, SEQUENCES_PER_GPU[-1], AUTO) for m in MODELS]
    if "AxoNN" in cals:
        cases += [("AxoNN", m, SEQUENCES_PER_GPU[-1], c) for c in (0, AUTO) for m in MODELS]
    return cases


def headline_lines() -> list[str]:
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
        "per call (no per-shape measurements exist for these GPUs);",
        "- sequence length 2048, full activation checkpointing, OAR, OAG and ORS on, the "
        "spec's defaults for the rest: `train.wire=auto` (bf16 weight all-gathers, "
        "weight-gradient reduce-scatters and dX all-reduces on GPUs), ORS window of 2 "
        "blocks (`train.ors_window=2`), `train.gemm_tuning=true`;",
        "- weight caching: 'cache' = 0 plans `train.cache_layers=0` (the configured "
        "default); 'auto' lets the planner choose per grid (the most blocks that still "
        "fit, if that is faster); the column shows the blocks chosen for the best grid;",
        "- global batch = GPUs x the factor shown (sequences); the paper's batch sizes and "
        "models for these runs are not in the readable sources;",
        "- Perlmutter: 4,096 A100-40GB (the GPU count is an inference, axonn.md §5.2);",
        "- bandwidths: 'profile' = the machine profile's nominal per-GPU intra-node and "
        "inter-node numbers; 'AxoNN' = the bus bandwidths AxoNN measured on Perlmutter and "
        "Frontier (Megatron-AxoNN's comm_model.py, axonn.md §4.2; "
        "`calibrate.published_calibration`), by group size and ranks per node, with the "
        "profile's latency.",
        "",
        "| machine | GPUs | reported | model | global batch | bandwidths | cache | best grid "
        "(data,x,y,z) | mb | cached blocks | step (s) | mem GiB | predicted | % of peak | "
        "predicted / reported |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for machine_name, nodes, reported in RUNS:
        hw = load([f"machine={machine_name}"]).machine.hardware
        world = nodes * hw.gpus_per_node
        cals = calibrations(machine_name)
        for source, model_name, per_gpu, cache in headline_cases(machine_name, cals):
            batch = int(world * per_gpu)
            row = best(machine_name, nodes, model_name, batch, cals[source], cache_layers=cache)
            head = (
                f"| {machine_name} | {world} | {flops_text(reported)} | {model_name} | {batch} |"
                f" {source} | {'auto' if cache is AUTO else cache} |"
            )
            if isinstance(row, str):
                lines.append(head + f" none: {row} | | | | | | | |")
                continue
            pflops = world * row.tflops_per_gpu / 1000
            lines.append(
                head + f" {grid_text(row)} | {row.micro_batch} | {row.cache_layers} | "
                f"{row.step_time_s:.2f} | {row.memory_gib:.1f} | {flops_text(pflops)} | "
                f"{100 * row.fraction_of_peak:.1f} | {pflops / reported:.2f} |"
            )
    lines += [
        "",
        "Reported % of peak (computed in axonn.md §5.2): Perlmutter 48.5%, Frontier 22.0%, "
        "Alps 23.4%. Predictions above the report show what the model leaves out: GEMMs of "
        "every shape at one fraction of peak (no term for the layout-dependent GEMM speed "
        "AxoNN tuned on Frontier, which calibration measures per shape where it is run), "
        "the GH200 power cap, and contention between collectives of different axes. "
        "Nominal bandwidths ('profile') are optimistic next to AxoNN's measurements. A "
        "calibration file measured on the machine (`python -m axonn_launch.calibrate "
        "model=... nodes=...`) replaces the assumed GEMM rates and bandwidths.",
    ]
    return lines


# --------------------------------------------------------------------------- validation


LADDER = [  # (what the core does, train changes), each adding one change to the previous
    ("before: fp32 wire, every block's reduce-scatter pending, no caching",
     dict(wire=FP32_WIRE, ors_window=0, cache_layers=0)),
    ("+ ORS window of 2 blocks", dict(wire=FP32_WIRE, ors_window=2, cache_layers=0)),
    ("+ bf16 on the wire (train.wire=auto) = the configured defaults",
     dict(ors_window=2, cache_layers=0)),
    ("+ weight caching chosen by the planner", dict(ors_window=2, cache_layers=AUTO)),
]  # fmt: skip


def validation_lines() -> list[str]:
    v = VALIDATION
    cals = calibrations(v["machine"])
    lines = [
        "# Validation: AxoNN's 80B GPT on 1,024 Perlmutter GPUs",
        "",
        "`python bench/headline_plans.py` (this file's section); the prediction of the "
        f"first row is `{VALIDATION_COMMAND}`.",
        "",
        "Published (arXiv 2305.13525, axonn.md §5.2): 80B GPT (42 layers, h=12288, 96 "
        "heads, §5.3) on 1,024 A100-40GB GPUs, 182 PF/s = **57% of peak**. Target: within "
        "±15% of it, i.e. 48.5-65.5%. The batch of that run is not in the readable sources; "
        "global batch 1024 sequences of 2048 tokens, full activation checkpointing. GEMMs "
        f"at the default {DEFAULT_GEMM_EFFICIENCY:.0%} of the 312 TF/s peak (there is no "
        "per-shape calibration of an A100 here); no number below is fitted to the "
        "published one.",
        "",
        "Each row adds one thing the training core now does, on top of the row above, and "
        "shows the planner's best grid for it. 'profile' bandwidths are the machine "
        "profile's nominal ones (NVLink 100 GB/s per GPU, 4 x 25 GB/s Slingshot NICs per "
        "node); 'AxoNN' are the bus bandwidths AxoNN measured on Perlmutter "
        "(comm_model.py's table, axonn.md §4.2: 80, 40 or 20 GB/s across nodes for 4, 2 or "
        "1 group members per node).",
        "",
        "| what the core does | bandwidths | best grid (data,x,y,z) | mb | cached blocks | "
        "mem GiB | step (s) | compute (s) | exposed comm (s) by axis | % of peak | "
        "vs. 57% |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pcts: dict[tuple[str, int], float] = {}
    for source in cals:
        for i, (what, changes) in enumerate(LADDER):
            row = best(v["machine"], v["nodes"], v["model"], v["global_batch"], cals[source],
                       **changes)  # fmt: skip
            pct = pcts[source, i] = 100 * row.fraction_of_peak
            lines.append(
                f"| {what} | {source} | {grid_text(row)} | {row.micro_batch} | "
                f"{row.cache_layers} | {row.memory_gib:.1f} | {row.step_time_s:.2f} | "
                f"{row.compute_s:.2f} | {comm_text(row)} | {pct:.1f} | "
                f"{pct / (100 * PUBLISHED_FRACTION) - 1:+.0%} |"
            )
    lines += ["", *validation_notes(pcts)]
    return lines


OLD_PLANNER = 35.7  # the same command before these changes (bench/results at 8615a6d)


def validation_notes(pct: dict[tuple[str, int], float]) -> list[str]:
    """What changed, with this run's numbers (``pct``: (bandwidths, ladder row) -> %)."""
    lo, hi = 100 * 0.85 * PUBLISHED_FRACTION, 100 * 1.15 * PUBLISHED_FRACTION

    def where(p: float) -> str:
        return "inside the band" if lo <= p <= hi else f"{p - hi:+.1f} points off the band"

    return [
        "What changed, and why the prediction moved from 35.7% (the planner before these "
        "changes) to the rows above:",
        "",
        "1. **ORS window** (`train.ors_window=2`). Before, every block's full fp32 "
        "weight-gradient block stayed alive until the next forward: 42 blocks x "
        "12h^2/(x*y) x 4 bytes = 304/(x*y) GB, so only grids with x*y >= 8-16 fitted 40 GiB "
        "and the best one split the heads over y=16 *across nodes* (4.1 s of exposed y "
        "all-reduces in a 11.6 s step). With at most 2 blocks pending the buffers are 2 "
        "blocks' (memory.py), grids with small x*y and z up to 128 fit, and the activation "
        "all-reduces move back onto NVLink. The window does not change what overlap "
        "hides in this model: when the reduce-scatter queue is full the compute waits, but the "
        "z link stays busy (perf.py, `_z_streams`).",
        "2. **bf16 on the wire** (`train.wire=auto`): weight all-gathers and weight-gradient "
        "reduce-scatters over z and the dX all-reduces over x and y move half the bytes; it "
        "also halves the gathered-weight and reduce-scatter buffers, which lets the planner "
        "take x=1 (no x all-reduces, no x-exact LayerNorm) with y inside a node.",
        "3. **Weight caching** (`train.cache_layers`, chosen by the planner when automatic): "
        "the first blocks keep their gathered weights, so their recompute and backward "
        "gathers disappear, and the backward's z stream drains behind their compute; the "
        "planner fills memory to the last block that fits. It is the planner's choice "
        "only when `train.cache_layers` is automatic; the configured default is 0.",
        "4. **Per-shape GEMMs**: the model now prices every GEMM at its own (m, n, k) when a "
        "calibration measured it (`python -m axonn_launch.calibrate model=gpt_80b nodes=256`); "
        "none exists for an A100 here, so every GEMM runs at the default efficiency and this "
        "change does not move the number.",
        "5. The z collectives that overlap now share one z link (gathers and reduce-scatters "
        "of the backward in one stream), where before each kind had the link to itself; and "
        "the recomputed forward now keeps its gathered weights for the backward that follows "
        "(3 z collectives per Linear, AxoNN's count, instead of 4), in every row including "
        f"the first. With both, the 'before' row is {pct['profile', 0]:.1f}% (the old "
        f"planner said {OLD_PLANNER}% for it: the shared link costs about what the kept "
        "recompute gather saves).",
        "",
        f"Honest reading: with AxoNN's measured bandwidths the prediction is "
        f"{pct['AxoNN', 2]:.1f}% without caching ({where(pct['AxoNN', 2])}) and "
        f"{pct['AxoNN', 3]:.1f}% with the planner's caching ({where(pct['AxoNN', 3])}). With "
        f"the profile's nominal bandwidths it is {pct['profile', 2]:.1f}% without caching "
        f"({where(pct['profile', 2])}) and {pct['profile', 3]:.1f}% with the planner's caching "
        f"({where(pct['profile', 3])}): nominal NIC bandwidth is about "
        "25% above what NCCL reaches (AxoNN measured 80 GB/s where 100 is nominal), and the "
        "model still leaves out the optimizer update, kernel launch gaps, GEMMs slowed by "
        "communication kernels sharing the SMs (overlap efficiency is taken as 1 without a "
        "calibration) and contention between collectives of different axes sharing a "
        "node's links. The validation therefore rests on the measured bandwidths, as a "
        "calibrated plan would: "
        "`test_the_published_80b_perlmutter_point_is_predicted_within_15_percent` "
        "(tests/cost/test_planner.py) pins the two AxoNN-bandwidth rows of the configured defaults "
        "(without and with the planner's caching) and that the chosen plan fits in memory; "
        "the nominal-bandwidth rows are reported, not pinned.",
    ]


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, lines in (("headline_plans.md", headline_lines()),
                        ("validation_80b.md", validation_lines())):  # fmt: skip
        (RESULTS / name).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
