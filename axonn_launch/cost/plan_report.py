"""The planner's report: what ``python -m axonn_launch.plan`` prints (its table, its
JSON, the launch command of each candidate, what spares and checkpoints cost), from
``PlanArgs``. The command (``axonn_launch/plan.py``) parses its arguments into them; the
Python API (``axonn_launch/api.py``) builds them from a composed config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass

from axonn_launch import scheduler
from axonn_launch.common.durations import duration
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware, MachineProfile
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig
from axonn_launch.cost import expected_goodput, startup
from axonn_launch.cost.jobcost import job_cost
from axonn_launch.cost.memory import fit_micro_batch
from axonn_launch.cost.perf import (
    COMM_AXES,
    OVERLAP_RANGE,
    Calibration,
    load_calibration,
    profile_calibration,
)
from axonn_launch.cost.planner import (
    HEADROOM,
    MAX_NODES,
    PlanError,
    PlanRow,
    Ranking,
    predicted_range,
    rank_machine,
    resolve_cache_layers,
    smallest_nodes,
    why_nothing_fits,
)


@dataclass(frozen=True)
class PlanArgs:
    machine: MachineProfile
    model: ModelSpec
    train: TrainConfig
    nodes: int | None  # None: the fewest nodes where a grid fits
    top: int
    output: str  # table | json
    calibration: Calibration | None
    overrides: tuple[str, ...] = ()  # the Hydra overrides as given, for the launch command
    spares: Spares | None = None  # None: the machine has no scheduler to hold spare nodes
    account_key: str = ""  # the override naming the account (compose.account_override)


@dataclass(frozen=True)
class Spares:
    """What ``plan`` prices spare nodes with (``spare_lines``)."""

    nodes: int  # recovery.spare_nodes, as composed (0: plan shows 1, as a what-if)
    restarts: int  # recovery.in_job_restarts
    queue_wait_s: float
    queue_wait_given: bool


def spares_of(cfg, queue_wait_h: str | None) -> Spares | None:
    """Spare nodes as composed, on a machine whose scheduler can hold them (Slurm)."""
    if not scheduler.of(cfg.machine).queued:
        return None
    wait_s = expected_goodput.DEFAULT_QUEUE_WAIT_S
    if queue_wait_h is not None:
        try:
            wait_s = float(queue_wait_h) * expected_goodput.HOUR_S
        except ValueError:
            wait_s = -1.0
        if not wait_s >= 0:
            raise PlanError(f"queue_wait_h={queue_wait_h!r}: must be a number of hours >= 0")
    return Spares(nodes=cfg.recovery.spare_nodes, restarts=cfg.recovery.in_job_restarts,
                  queue_wait_s=wait_s, queue_wait_given=queue_wait_h is not None)  # fmt: skip


def read_calibration(path: str, base: Calibration | None = None) -> Calibration:
    """The file's measurements over ``base`` (the profile's) for what it did not measure."""
    hint = "write one with python -m axonn_launch.calibrate (it prints the file's path)"
    if not os.path.isfile(path):
        raise PlanError(f"calibration={path!r}: no such file; {hint}")
    try:
        return load_calibration(path, base)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PlanError(f"calibration={path!r}: not a calibration file ({exc}); {hint}") from exc


def positive_int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise PlanError(f"{key}={text!r}: must be a positive integer")
    return value


def format_table(rows: list[PlanRow], peak: float) -> str:
    """The plan as aligned columns; the last ones split the step into compute and the
    exposed communication of each axis (xy = the vocab-parallel plane)."""
    head = ["rank", "grid (data,x,y,z)", "mb", "cache", "step s", "TFLOP/s/GPU", "% peak"]
    head += ["mem GiB"]
    head += ["compute s"] + [f"{a} s" for a in COMM_AXES]
    lines = [head]
    for r in rows:
        g = r.grid
        pct = f"{100 * r.fraction_of_peak:.1f}" if peak > 0 else "-"
        line = [str(r.rank), f"({g.data},{g.x},{g.y},{g.z})", str(r.micro_batch)]
        line += [str(r.cache_layers)]
        line += [f"{r.step_time_s:.4g}", f"{r.tflops_per_gpu:.4g}", pct, f"{r.memory_gib:.1f}"]
        line += [f"{r.compute_s:.4g}"] + [f"{r.comm_s[a]:.2f}" for a in COMM_AXES]  # <= 120 wide
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def plan_report(args: PlanArgs) -> tuple[str, bool]:
    """(text to print, whether any grid was found)."""
    nodes, note = args.nodes, ""
    if nodes is None:
        try:
            nodes = smallest_nodes(
                machine=args.machine,
                model=args.model,
                train=args.train,
                calibration=args.calibration,
            )
        except PlanError as exc:
            return f"{exc}; no node count up to {MAX_NODES} fits", False
        note = f"nodes not given: planning for nodes={nodes}, the fewest where a grid fits\n"
    ranking = rank_machine(args.machine, args.model, args.train, nodes, args.calibration)
    rows = ranking.rows[: args.top]
    why = "" if rows else _why(args, nodes)
    if args.output == "json":
        return json.dumps(plan_json(args, nodes, ranking, rows, why), indent=2), bool(rows)
    hw, tr = args.machine.hardware, args.train
    header = (
        f"{note}{args.model.name} on {nodes} node(s) of {args.machine.name} = "
        f"{nodes * hw.gpus_per_node} GPUs ({hw.gpu_model}); global_batch={tr.global_batch} "
        f"seq_len={tr.seq_len} "
        f"activation_checkpointing={tr.activation_checkpointing}\n"
        f"{ranking.considered} grids, {len(ranking.rows)} runnable"
        + "".join(f", {n} rejected ({k})" for k, n in ranking.rejected.items())
    )
    if not rows:
        return f"{header}\n{why}", False
    table = format_table(rows, hw.peak_tflops_per_gpu)
    lines = [header, table, job_start_line(args, rows[0].grid), *startup_lines(args, nodes)]
    ck = checkpointing(args, rows[0], nodes)
    lines += checkpoint_lines(ck, args.machine) + spare_lines(args, ck) + [legend(hw)]
    lines += [calibration_note(args), *input_lines(args, rows[0])]
    lines += launch_lines(args, rows[0], nodes)
    return "\n".join(lines), True


def legend(hw: Hardware) -> str:
    """What each column means; ``rank`` above all, which is no MPI rank."""
    memory = f" (a GPU has {hw.mem_per_gpu_gb:g})" if hw.mem_per_gpu_gb > 0 else ""
    peak = f"{hw.peak_tflops_per_gpu:g} TFLOP/s" if hw.peak_tflops_per_gpu > 0 else "unknown: -"
    columns = [
        (
            "rank",
            f"place in this ranking: grids within {HEADROOM:.0%} of GPU memory first, each"
            " by predicted step time (1 = what grid=auto runs); not an MPI rank",
        ),
        ("grid", "ranks on each axis: data replicas, x and y (tensor), z (depth)"),
        ("mb", "micro-batch: sequences per micro-step of a data replica, split over z"),
        ("cache", "blocks whose gathered weights stay from forward to backward (cache_layers)"),
        ("step s", "predicted seconds per optimizer step"),
        ("% peak", f"TFLOP/s/GPU over the GPU's peak ({peak})"),
        ("mem GiB", f"estimated memory per GPU{memory}"),
        ("compute s", "GEMM and element-wise time of a step"),
        ("x/y/z/data s", "communication over that axis that compute does not hide"),
        ("xy s", "the same for the token table and loss, split over the x*y plane"),
    ]
    width = max(len(name) for name, _ in columns)
    return "\n".join(["columns:", *(f"  {n.ljust(width)}  {t}" for n, t in columns)])


def calibration_note(args: PlanArgs) -> str:
    """Whether the figures rest on measurements of this machine or on the profile's."""
    if args.calibration is not None:
        return f"predictions calibrated with {args.calibration.source} (measured on the machine)"
    machine = args.machine
    measure = f"python -m axonn_launch.calibrate machine={machine.name}"
    if scheduler.of(machine).on_this_computer:
        measure = f"`{measure} nproc={machine.hardware.gpus_per_node} out=cal.json`"
    else:
        measure = f"`srun ... {measure} out=cal.json` in an allocation (one task per GPU)"
    return (
        f"uncalibrated predictions: machine={machine.name}'s profile (inputs below), no"
        f" calibration file; calibrate with {measure}, then pass calibration=cal.json"
    )


UNCITED = "an uncited default"


def plan_inputs(args: PlanArgs) -> list[dict[str, str]]:
    """What the predictions rest on: each input's value and its source (the profile's
    ``sources``, a calibration file), or named an uncited default."""
    hw, src = args.machine.hardware, args.machine.sources
    cal = args.calibration or profile_calibration(hw)
    file = f"measured: {cal.source}" if args.calibration is not None else ""
    gemm_file = file if cal.gemm_efficiency_range is None else ""
    low, high = cal.gemm_efficiency_range or (cal.gemm_efficiency,) * 2
    links_file = file if cal.collectives and not hw.bus_gbps else ""
    links = "measured table (hardware.bus_gbps)" if hw.bus_gbps else "nominal (hardware.*_gbps)"
    spread = f" (measured {low:g}-{high:g})" if high > low else ""
    how = f"{UNCITED}; measure it with python -m axonn_launch.calibrate on 2+ GPUs"
    return [
        _input("peak", f"{hw.peak_tflops_per_gpu:g} TFLOP/s/GPU dense bf16",
               src.get("hardware.peak_tflops_per_gpu", UNCITED)),
        _input("GEMM efficiency", f"{cal.gemm_efficiency:g}{spread}",
               gemm_file or src.get("hardware.gemm_efficiency", UNCITED)),
        _input("HBM bandwidth", f"{hw.memory_gbps:g} GB/s",
               src.get("hardware.memory_gbps", UNCITED)),
        _input("bus bandwidths", links_file and "measured by calibrate" or links,
               links_file or src.get("hardware.bus_gbps", UNCITED)),
        _input("latency", f"{hw.latency_us:g} us per ring step", links_file or UNCITED),
        _input("overlap efficiency", f"{cal.overlap_efficiency:g}",
               file if cal.overlap_measured else how),
    ]  # fmt: skip


def _input(name: str, value: str, source: str) -> dict[str, str]:
    return {"name": name, "value": value, "source": source}


def input_lines(args: PlanArgs, row: PlanRow) -> list[str]:
    """The inputs with their sources, then rank 1's range with the uncertain ones at their
    ends (``planner.predicted_range``): a range, not one figure."""
    lo, hi = plan_range(args, row)
    lines = ["inputs (source, or an uncited default):"]
    lines += [f"  {i['name']}: {i['value']}: {_short(i['source'])}" for i in plan_inputs(args)]
    lines.append(f"range of rank 1 over {range_terms(args)}: {hi['step_time_s']:.4g}-"
                 f"{lo['step_time_s']:.4g} s/step, {100 * lo['fraction_of_peak']:.1f}-"
                 f"{100 * hi['fraction_of_peak']:.1f}% of peak")  # fmt: skip
    return lines


def _short(source: str) -> str:
    """A source's citation without its note (the note is in the profile and in JSON)."""
    return source.split(" (", 1)[0]


def range_terms(args: PlanArgs) -> str:
    """The uncertain inputs the range spans, with their ends."""
    cal = args.calibration or profile_calibration(args.machine.hardware)
    terms = []
    if cal.gemm_efficiency_range and cal.gemm_efficiency_range[0] < cal.gemm_efficiency_range[1]:
        terms.append("GEMM efficiency {:g}-{:g}".format(*cal.gemm_efficiency_range))
    if not cal.overlap_measured:
        terms.append("overlap efficiency {:g}-{:g}".format(*OVERLAP_RANGE))
    return ", ".join(terms) or "no unmeasured input"


def plan_range(args: PlanArgs, row: PlanRow) -> tuple[dict[str, float], dict[str, float]]:
    """(slowest, fastest) step seconds and fraction of peak of ``row``."""
    ends = predicted_range(args.machine.hardware, args.model, args.train, row, args.calibration)
    return tuple(  # type: ignore[return-value]
        {"step_time_s": st.total, "fraction_of_peak": st.fraction_of_peak} for st in ends
    )


# overrides the launch command sets itself (the best row's grid and node count)
LAUNCH_OWN_KEYS = ("grid", "nodes")


def launch_command(args: PlanArgs, row: PlanRow, nodes: int) -> str:
    """The launcher's command line for ``row``: machine, model, its grid and node count,
    then plan's other overrides as given, each shell-quoted. A cache choice the launcher
    would not make itself (one that rests on a calibration) is pinned."""
    given = {_override_key(o): o for o in args.overrides}
    g = row.grid
    words = [
        given.get("machine", f"machine={args.machine.name}"),
        given.get("model", f"model={args.model.name}"),
        f"grid.data={g.data}", f"grid.x={g.x}", f"grid.y={g.y}", f"grid.z={g.z}", f"nodes={nodes}",
    ]  # fmt: skip
    words += [o for o in args.overrides if not _set_by_launch(_override_key(o))]
    if args.train.micro_batch is None and launcher_micro_batch(args, g) != row.micro_batch:
        words.append(f"train.micro_batch={row.micro_batch}")  # the planner's, for headroom
    tr = dataclasses.replace(args.train, micro_batch=row.micro_batch)
    if resolve_cache_layers(args.machine.hardware, args.model, tr, g) != row.cache_layers:
        words.append(f"train.cache_layers={row.cache_layers}")
    return " ".join(["python", "-m", "axonn_launch", *map(shlex.quote, words)])


def launcher_micro_batch(args: PlanArgs, grid: Grid) -> int | None:
    """The micro-batch the launcher takes on its own for an explicit ``grid``: the largest
    that fits (``fit_micro_batch``), which may leave less headroom than the planner's."""
    chosen = fit_micro_batch(args.model, grid, args.train, args.machine.hardware)
    return None if isinstance(chosen, str) else chosen[0]


def launch_lines(args: PlanArgs, row: PlanRow, nodes: int) -> list[str]:
    """The last lines: what to run next (the command alone on the last line)."""
    missing = [k for k in args.machine.required if not _attribute(args.machine, k)]
    need = f"; a real submission also needs machine.{', machine.'.join(missing)}" if missing else ""
    key = args.account_key or f"site.accounts.{args.machine.name}"
    hint = f" ({key}=...)" if "slurm.account" in missing else ""
    return [
        f"launch the best grid (rank 1); add dry_run=true to check it first{need}{hint}:",
        launch_command(args, row, nodes),
    ]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _set_by_launch(key: str) -> bool:
    top = key.split(".", 1)[0]
    return key in ("machine", "model") or top in LAUNCH_OWN_KEYS


def _attribute(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def job_start_line(args: PlanArgs, grid: Grid) -> str:
    """Host memory and init time per rank of the best grid (axonn_launch/cost/jobcost.py)."""
    cost = job_cost(args.model, grid, on_gpu=args.machine.hardware.runs_on_gpu)
    return f"job start, save and resume on {grid.describe()}: {cost.describe()}"


def startup_of(args: PlanArgs, nodes: int) -> startup.Startup | None:
    """The job's start-up at ``nodes`` (``cost/startup.py``); None where the machine's
    scheduler starts no batch job (this computer)."""
    return startup.startup(args.machine, nodes) if scheduler.of(args.machine).queued else None


def startup_lines(args: PlanArgs, nodes: int) -> list[str]:
    """Two lines: the start-up at this node count, labelled, with its phases; then the
    start-up at a quarter, half, twice and four times as many nodes."""
    up = startup_of(args, nodes)
    if up is None:
        return []
    phases = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in up.seconds.items())
    others = ", ".join(
        f"{n:,} nodes {duration(s.total_s)} ({s.label if s.extrapolated else 'fitted, ' + s.label})"
        for n, s in _startups_around(args, nodes).items()
    )
    return [
        f"{up.words()} (sbatch to the last task started; the torch import, rendezvous and"
        f" model init not in it): {phases} (cost/startup.py)",
        f"start-up by node count: {others}",
    ]


def _startups_around(args: PlanArgs, nodes: int) -> dict[int, startup.Startup]:
    """The start-up at nodes/4, nodes/2, nodes, 2 nodes and 4 nodes (at least 1 node)."""
    counts = sorted({max(1, nodes * k // 4) for k in (1, 2, 4, 8, 16)})
    return {n: startup.startup(args.machine, n) for n in counts}


def restart_words(ck: expected_goodput.Checkpointing) -> str:
    """What the restart is made of: the profile's restart_s, or detection + start-up."""
    return "" if ck.restart is None else f"{ck.restart.words()}, + the read-back"


def checkpointing(
    args: PlanArgs, row: PlanRow, nodes: int
) -> expected_goodput.Checkpointing | None:
    """The checkpoint interval and expected goodput of ``row``
    (``cost/expected_goodput.py``): auto's (Young/Daly) and, unless auto was asked for,
    the composed ``train.checkpoint_every``'s."""
    return expected_goodput.predict(
        machine=args.machine,
        model=args.model,
        nodes=nodes,
        step_s=row.step_time_s,
        steps=args.train.steps,
        every=args.train.checkpoint_every,
    )


def checkpoint_lines(
    ck: expected_goodput.Checkpointing | None, machine: MachineProfile
) -> list[str]:
    """Two lines: the interval and goodput of the best grid, then what they rest on (on a
    CPU profile, failure figures that are test values: said so)."""
    if ck is None:
        return [
            "checkpoints: no failure rate in the machine profile"
            " (machine.reliability.node_mtbf_hours=0): no interval or goodput predicted"
        ]
    composed = f"; with train.checkpoint_every={ck.every} (as composed): {ck.goodput:.1%}"
    return [
        f"checkpoints of rank 1 (Young/Daly): every {ck.auto_steps:,} steps ="
        f" {ck.optimal_s:.0f} s at {ck.step_s:.4g} s/step (train.checkpoint_every=auto);"
        f" expected goodput {ck.auto_goodput:.1%}{'' if ck.auto else composed}",
        f"  from: job MTBF {ck.mtbf_s / 3600:.3g} h ({ck.node_mtbf_hours:,.4g} h per node /"
        f" {ck.nodes:,} nodes), a save {ck.save_s:.3g} s ({ck.checkpoint_gb:,.4g} GB at"
        f" {ck.write_gbps:,.4g} GB/s), restart {ck.restart_s:.0f} s ({restart_words(ck)})"
        " (cost/expected_goodput.py)"
        + (
            f"; machine={machine.name}'s failure figures are test values: no prediction for a"
            " CPU run"
            if machine.hardware.gpu_model == "cpu"
            else ""
        ),
    ]


def spare_cost(
    args: PlanArgs, ck: expected_goodput.Checkpointing | None
) -> expected_goodput.SpareCost | None:
    """The spares' node-hours and goodput (``cost/expected_goodput.spare_cost``); None
    without a scheduler to hold them or a failure rate. With none composed, for 1."""
    if args.spares is None or ck is None:
        return None
    sp = args.spares
    return expected_goodput.spare_cost(ck, max(1, sp.nodes), sp.restarts, sp.queue_wait_s)


def spare_lines(args: PlanArgs, ck: expected_goodput.Checkpointing | None) -> list[str]:
    """Two lines: the spares' node-hours next to the goodput with them and without, then
    what that rests on."""
    cost = spare_cost(args, ck)
    if cost is None or args.spares is None:
        return []
    sp = args.spares
    asked = (f"recovery.spare_nodes={sp.nodes}" if sp.nodes
             else "recovery.spare_nodes=0; with 1")  # fmt: skip
    wait = (f"queue_wait_h={sp.queue_wait_s / 3600:g}" if sp.queue_wait_given
            else f"{sp.queue_wait_s / 3600:g} h, {UNCITED}: set queue_wait_h=")  # fmt: skip
    return [
        f"spares ({asked}): {cost.node_hours:,.4g} node-h idle over the run"
        f" (+{cost.spares / cost.nodes:.0%} of the grid's nodes); goodput over the wall time"
        f" {cost.goodput_with:.1%} with, {cost.goodput_without:.1%} without"
        f" ({cost.wall_s_with / 3600:,.4g} h against {cost.wall_s_without / 3600:,.4g} h)",
        f"  from: {cost.failures:.3g} node failures expected, {cost.in_place:.0%} of them"
        f" restarted on a spare (recovery.in_job_restarts={sp.restarts}), the rest wait in"
        f" the queue for a new job ({wait}) (cost/expected_goodput.py)",
    ]


def _why(args: PlanArgs, nodes: int) -> str:
    return why_nothing_fits(
        machine=args.machine,
        model=args.model,
        train=args.train,
        nodes=nodes,
        calibration=args.calibration,
    )


def plan_json(args: PlanArgs, nodes: int, ranking: Ranking, rows: list[PlanRow], why: str):
    hw, tr = args.machine.hardware, args.train
    return {
        "machine": args.machine.name,
        "model": args.model.name,
        "nodes": nodes,
        "nodes_given": args.nodes is not None,
        "world_size": nodes * hw.gpus_per_node,
        "train": {
            "global_batch": tr.global_batch,
            "seq_len": tr.seq_len,
            "activation_checkpointing": tr.activation_checkpointing,
            "overlap": dataclasses.asdict(tr.overlap),
            "wire": dataclasses.asdict(tr.wire),
            "cache_layers": tr.cache_layers,  # None: chosen per grid (plans[i].cache_layers)
            "ors_window": tr.ors_window,
            "gemm_tuning": tr.gemm_tuning,
        },
        "calibration": args.calibration.source if args.calibration else None,
        "inputs": plan_inputs(args),
        "considered": ranking.considered,
        "rejected": ranking.rejected,
        "plans": [r.as_dict() for r in rows],
        **({"range": _range_json(args, rows[0])} if rows else {}),
        **({"job_start": job_start_line(args, rows[0].grid)} if rows else {}),
        "startup": _startup_json(args, nodes),
        **({"checkpointing": _checkpointing_json(args, rows[0], nodes)} if rows else {}),
        **({"spares": _spares_json(args, rows[0], nodes)} if rows else {}),
        **({"launch_command": launch_command(args, rows[0], nodes)} if rows else {}),
        **({"why_none": why} if why else {}),
    }


def _range_json(args: PlanArgs, row: PlanRow) -> dict[str, object]:
    slow, fast = plan_range(args, row)
    return {"over": range_terms(args), "slowest": slow, "fastest": fast}


def _startup_json(args: PlanArgs, nodes: int) -> dict | None:
    up = startup_of(args, nodes)
    if up is None:
        return None
    around = {str(n): s.total_s for n, s in _startups_around(args, nodes).items()}
    return {**up.as_dict(), "by_nodes": around}


def _checkpointing_json(args: PlanArgs, row: PlanRow, nodes: int) -> dict | None:
    ck = checkpointing(args, row, nodes)
    return None if ck is None else ck.as_dict()


def _spares_json(args: PlanArgs, row: PlanRow, nodes: int) -> dict | None:
    cost = spare_cost(args, checkpointing(args, row, nodes))
    if cost is None or args.spares is None:
        return None
    return {**cost.as_dict(), "composed": args.spares.nodes,
            "queue_wait_given": args.spares.queue_wait_given}  # fmt: skip
