"""The planner's choice for AxoNN's published runs, beside the reported numbers.

    python bench/headline_plans.py
        # writes bench/results/headline_plans.md and bench/results/validation_80b.md

Gordon Bell headline runs (arXiv 2502.08145, axonn.md §5.2): Perlmutter 620.1 PF/s
(4,096 A100s is an inference), Frontier 1.381 EF/s on 32,768 MI250X GCDs, Alps 1.423
EF/s on 6,144 GH200s. Neither their models nor their batch sizes are in the readable
sources, so each machine is planned for a few presets and global batches.

The validation point (arXiv 2305.13525, axonn.md §5.2): an 80B GPT (§5.3 shape) on
1,024 Perlmutter A100-40GB GPUs at 182 PF/s, 57% of peak. Its batch is not in the
readable sources either; the planner is asked for global batches 512 and 1024. The file shows the
prediction, the grid, the step's breakdown and what each modelled change of the
training core contributes, before and after the cited defaults (nothing fitted).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.common.spec import WireConfig
from axonn_launch.config.compose import load
from axonn_launch.cost.perf import Calibration, profile_calibration
from axonn_launch.cost.planner import PlanRow, best_grid, predicted_range

RESULTS = Path(__file__).parent / "results"
RUNS = [  # machine, nodes, reported PF/s
    ("perlmutter", 1024, 620.1),
    ("frontier", 4096, 1381.0),
    ("alps", 1536, 1423.0),
]
MODELS = ("gpt_80b", "gpt_320b", "gpt_640b")
SEQUENCES_PER_GPU = (0.25, 0.5, 1)  # global batch = this * GPUs (sequences of 2048 tokens)
AUTO = None  # train.cache_layers: the planner chooses per grid
FP32_WIRE = WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32")
# before: the planner's old defaults (GEMMs at 0.75 of peak on every machine, the profile's
# nominal links, full overlap); after: the profile's cited inputs (perf.profile_calibration)
BEFORE = Calibration()

VALIDATION = dict(machine="perlmutter", model="gpt_80b", nodes=256)
VALIDATION_BATCHES = (512, 1024)  # the preset's, and the batch the earlier runs assumed
PUBLISHED_FRACTION = 0.57
VALIDATION_COMMAND = "python -m axonn_launch.plan machine=perlmutter model=gpt_80b nodes=256"


def configured(machine_name, model_name, global_batch, **train_changes):
    overrides = [f"machine={machine_name}", f"model={model_name}", "train.seq_len=2048"]
    cfg = load([*overrides, f"train.global_batch={global_batch}"])
    return cfg, dataclasses.replace(cfg.train, **train_changes)


def best(machine_name, nodes, model_name, global_batch, cal, **train_changes) -> PlanRow | str:
    """The planner's best row, or why there is none; ``cal`` None: the profile's inputs."""
    cfg, train = configured(machine_name, model_name, global_batch, **train_changes)
    try:
        return best_grid(machine=cfg.machine, model=cfg.model, train=train, nodes=nodes,
                         calibration=cal)  # fmt: skip
    except ValueError as exc:
        return str(exc)


def fraction_range(machine_name, model_name, global_batch, row: PlanRow, **train_changes):
    """(lowest, highest) fraction of peak of ``row`` over the uncertain inputs."""
    cfg, train = configured(machine_name, model_name, global_batch, **train_changes)
    slow, fast = predicted_range(cfg.machine.hardware, cfg.model, train, row)
    return slow.fraction_of_peak, fast.fraction_of_peak


def grid_text(row: PlanRow) -> str:
    g = row.grid
    return f"({g.data},{g.x},{g.y},{g.z})"


def flops_text(pflops: float) -> str:
    return f"{pflops / 1000:.3f} EF/s" if pflops >= 1000 else f"{pflops:.1f} PF/s"


def comm_text(row: PlanRow) -> str:
    return ", ".join(f"{a} {t:.2f}" for a, t in row.comm_s.items() if t >= 0.005) or "-"


def inputs_text(machine_name: str) -> str:
    hw = load([f"machine={machine_name}"]).machine.hardware
    cal = profile_calibration(hw)
    low, high = cal.gemm_efficiency_range or (cal.gemm_efficiency,) * 2
    gemm = f"GEMM {low:g}" + (f"-{high:g}" if high > low else "")
    links = "AxoNN's measured bus table" if hw.bus_gbps else "nominal links (no measured table)"
    return f"{machine_name}: {gemm} of peak, {links}"


# --------------------------------------------------------------------------- headline table


def headline_lines() -> list[str]:
    lines = [
        "# Planned headline runs vs. the AxoNN Gordon Bell numbers",
        "",
        "`python bench/headline_plans.py`. For each machine, model and global batch, the "
        "planner's best grid (`best_grid`) and its predicted whole-machine model FLOP/s "
        "(Narayanan's count with full activation recompute, as Megatron-AxoNN counts), "
        "before and after the planner's defaults came from cited measurements.",
        "",
        "- **before**: every GEMM at 0.75 of peak on every machine (uncited), the profile's "
        "nominal link speeds, full overlap (e = 1);",
        "- **after**: the machine profile's cited inputs (`perf.profile_calibration`, each "
        "source in the profile's `sources` and in `plan`'s output): "
        + "; ".join(inputs_text(m) for m, _, _ in RUNS)
        + ". The overlap efficiency stays the uncited default e = 1 (no published value for "
        "NCCL/RCCL on these machines; `calibrate` measures it), so the 'after range' column "
        "spans e = 0-1 and the GEMM efficiency's cited range: a range, not one figure;",
        "- both: sequence length 2048, full activation checkpointing, OAR/OAG/ORS on, "
        "`train.wire=auto`, `train.cache_layers=0`; global batch = GPUs x the factor shown "
        "(the paper's batches and models for these runs are not in the readable sources); "
        "Perlmutter's 4,096 A100s are an inference (axonn.md §5.2). Nothing is fitted to "
        "the reported numbers.",
        "",
        "| machine | GPUs | reported | model | global batch | before: grid | before: "
        "predicted / reported | after: grid (data,x,y,z) | after: predicted | after: % of "
        "peak | after: predicted / reported | after range / reported |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for machine_name, nodes, reported in RUNS:
        world = nodes * load([f"machine={machine_name}"]).machine.hardware.gpus_per_node
        for model_name in MODELS:
            for per_gpu in SEQUENCES_PER_GPU:
                lines.append(headline_row(machine_name, nodes, world, reported, model_name,
                                          int(world * per_gpu)))  # fmt: skip
    lines += [
        "",
        "Reported % of peak (computed in axonn.md §5.2): Perlmutter 48.5%, Frontier 22.0%, "
        "Alps 23.4%. The range's low end is serial communication (e = 0); the point is e = 1. "
        "What the cited inputs cannot close (../shared/reference/planner_audit.md §3): on "
        "Frontier the MI250X GEMM rate at training shapes after AxoNN's NN/NT tuning, RCCL at "
        "4,096 nodes and e are unmeasured; on Alps the 660 W power cap, with no measured bus "
        "table. A calibration file measured on the machine (`python -m axonn_launch.calibrate "
        "model=... nodes=...`) replaces the assumed GEMM rates, bandwidths and e.",
    ]
    return lines


def headline_row(machine_name, nodes, world, reported, model_name, batch) -> str:
    head = f"| {machine_name} | {world} | {flops_text(reported)} | {model_name} | {batch} |"
    old = best(machine_name, nodes, model_name, batch, BEFORE, cache_layers=0)
    new = best(machine_name, nodes, model_name, batch, None, cache_layers=0)
    if isinstance(old, str) or isinstance(new, str):
        why = old if isinstance(old, str) else new
        return head + f" none: {why} | | | | | | |"
    ratio = world / 1000 / reported
    low, high = fraction_range(machine_name, model_name, batch, new, cache_layers=0)
    peak = new.step.peak_tflops
    return (
        head + f" {grid_text(old)} | {old.tflops_per_gpu * ratio:.2f} | {grid_text(new)} | "
        f"{flops_text(world * new.tflops_per_gpu / 1000)} | {100 * new.fraction_of_peak:.1f} | "
        f"{new.tflops_per_gpu * ratio:.2f} | {low * peak * ratio:.2f}-{high * peak * ratio:.2f} |"
    )


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
    v, lo, hi = VALIDATION, 85 * PUBLISHED_FRACTION, 115 * PUBLISHED_FRACTION
    lines = [
        "# Validation: AxoNN's 80B GPT on 1,024 Perlmutter GPUs",
        "",
        f"`python bench/headline_plans.py` (this file's section); the 'after' rows are "
        f"`{VALIDATION_COMMAND}` (and `train.global_batch=1024`), whose output lists every "
        "input with its source and the range.",
        "",
        "Published (arXiv 2305.13525, axonn.md §5.2): 80B GPT (42 layers, h=12288, 96 heads, "
        f"§5.3) on 1,024 A100-40GB GPUs, 182 PF/s = **57% of peak**. Target: {lo:.1f}-{hi:.1f}% "
        "(±15%). The run's batch is not in the readable sources: the preset's 512 and 1024 "
        "sequences of 2048 tokens, full activation checkpointing. 'before' is the planner's old "
        "defaults (GEMMs at 0.75 of peak, nominal NVLink 100 GB/s and 4 x 25 GB/s NICs, e = 1); "
        "'after' the profile's cited inputs: " + inputs_text("perlmutter") + " (80, 40 or 20 "
        "GB/s across nodes for 4, 2 or 1 group members per node), e = 1 the uncited default. "
        "Nothing is fitted to the published point.",
        "",
        "| global batch | inputs | best grid (data,x,y,z) | mb | step (s) | compute (s) | "
        "exposed comm (s) by axis | % of peak | vs. 57% | range over GEMM 0.69-0.75, e 0-1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct: dict[tuple[int, str], float] = {}
    for batch in VALIDATION_BATCHES:
        for name, cal in (("before", BEFORE), ("after", None)):
            row = best(v["machine"], v["nodes"], v["model"], batch, cal, cache_layers=0)
            p = pct[batch, name] = 100 * row.fraction_of_peak
            spread = "-"
            if cal is None:
                low, high = fraction_range(v["machine"], v["model"], batch, row, cache_layers=0)
                spread = f"{100 * low:.1f}-{100 * high:.1f}%"
            lines.append(
                f"| {batch} | {name} | {grid_text(row)} | {row.micro_batch} | "
                f"{row.step_time_s:.2f} | {row.compute_s:.2f} | {comm_text(row)} | {p:.1f} | "
                f"{p / (100 * PUBLISHED_FRACTION) - 1:+.0%} | {spread} |"
            )
    lines += ["", *ladder_lines(), "", *validation_notes(pct)]
    return lines


def ladder_lines() -> list[str]:
    """What each change of the training core contributes, with the cited inputs."""
    v = VALIDATION
    lines = [
        "Each row below adds one thing the training core does to the row above (global batch "
        "1024, the cited inputs):",
        "",
        "| what the core does | best grid (data,x,y,z) | mb | cached blocks | mem GiB | "
        "step (s) | exposed comm (s) by axis | % of peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for what, changes in LADDER:
        row = best(v["machine"], v["nodes"], v["model"], 1024, None, **changes)
        lines.append(
            f"| {what} | {grid_text(row)} | {row.micro_batch} | {row.cache_layers} | "
            f"{row.memory_gib:.1f} | {row.step_time_s:.2f} | {comm_text(row)} | "
            f"{100 * row.fraction_of_peak:.1f} |"
        )
    return lines


def validation_notes(pct: dict[tuple[int, str], float]) -> list[str]:
    """What moved, with this run's numbers (``pct``: (batch, before|after) -> %)."""
    return [
        f"Reading: at batch 1024 the prediction moves from {pct[1024, 'before']:.1f}% to "
        f"{pct[1024, 'after']:.1f}%, at the preset's 512 from {pct[512, 'before']:.1f}% to "
        f"{pct[512, 'after']:.1f}%, both inside the band. Two cited inputs move it: the A100's "
        "measured GEMM rate (0.69 of peak at 8192^3, PCIe part; 0.75 at 4096^3) in place of "
        "0.75 everywhere, and AxoNN's measured bus bandwidths in place of the nominal NIC "
        "speeds (80 measured where 100 is nominal). The overlap efficiency is the one input "
        "without a source: at e = 0 (every collective exposed) the same grid falls to the "
        "range's low end, far below the band, so the point rests on e being close to 1 on "
        "Perlmutter, which `calibrate` can measure on 2 GPUs. "
        "`test_the_published_80b_perlmutter_point_is_predicted_within_15_percent` "
        "(tests/cost/test_planner.py) pins both batches through `plan`'s own output, that every "
        "input but the latency and e is cited, and that the range holds the point.",
    ]


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, lines in (("headline_plans.md", headline_lines()),
                        ("validation_80b.md", validation_lines())):  # fmt: skip
        (RESULTS / name).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
