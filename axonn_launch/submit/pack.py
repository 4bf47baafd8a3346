"""Packed sweeps (``sweep.pack=auto|<nodes>``): the Slurm points of a multirun share a few
allocations instead of one job each. A point is checked, written and rendered as usual,
then waits (job.json ``status: packed``); when the sweep has seen every point, the points
that share their batch options are planned into packs and each pack is one ``sbatch``.
Inside it, ``axonn_launch.pack`` (``batch/pack_runner.py``) runs each point's own batch
script as steps on nodes of the pack, starting later points as earlier ones end.

A point keeps its own job dir, job.json, classification and restarts in place; a failed
point is restarted on its own nodes, never the whole pack. Why and what is left out:
``docs/launch.md`` ("packed sweeps").
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.common.jobdir import (
    ARRAY_LOG,
    PACK_LOG,
    PACK_PENDING,
    PACK_PLAN,
    PACK_SCRIPT,
    PACKS,
    update_record,
)
from axonn_launch.common.machine import SlurmSettings
from axonn_launch.config.compose import ConfigError, LaunchConfig
from axonn_launch.scheduler.slurm import SLURM
from axonn_launch.submit import allocation, chain

NODES_VARIABLE = "AXONN_PACK_NODES"  # a packed point's nodes: its script's srun --nodelist
# the #SBATCH options a pack sets itself; a point's others are shared by its pack
PACK_OWN = ("nodes", "time", "job-name", "output", "error", "signal", "requeue", "no-requeue",
            "no-kill")  # fmt: skip


# --- the point's side ----------------------------------------------------------------------


ARRAY = -1  # sweep.pack=array's width: each point a task of a job array, on its own nodes


def width_of(cfg: LaunchConfig) -> int | None:
    """``sweep.pack`` as nodes: None for off, 0 for auto, ``ARRAY`` for array (one line
    for a bad value)."""
    pack = str(cfg.sweep.pack).strip().lower()
    if pack in ("off", "false"):
        return None
    if pack in ("auto", "array"):
        return 0 if pack == "auto" else ARRAY
    if not pack.isdigit() or int(pack) < 1:
        raise ConfigError(
            f"sweep.pack={cfg.sweep.pack!r}: valid: off, auto, array, or a node count >= 1"
        )
    return int(pack)


def packed(cfg: LaunchConfig) -> bool:
    """Whether this launch is a packed sweep's point: a multirun of a Slurm machine with
    ``sweep.pack`` on (never a rehearsal, which runs once on its own)."""
    if width_of(cfg) is None or cfg.rehearse or not allocation.sweeping():
        return False
    return scheduler.of(cfg.machine).queued


def check(cfg: LaunchConfig, nodes: int) -> None:
    """The login node's check of a packed point (ConfigError, one line): what packing
    cannot do, and a point larger or longer than its pack."""
    width = width_of(cfg)
    if width is None or not allocation.sweeping():
        return
    if not scheduler.of(cfg.machine).queued:
        raise ConfigError(
            f"sweep.pack={cfg.sweep.pack}: machine={cfg.machine.name} has no Slurm allocation"
            " to pack points into; valid: off, or a Slurm machine"
        )
    if cfg.wait:
        raise ConfigError(
            f"sweep.pack={cfg.sweep.pack} with wait=true: packed points start when the whole"
            " sweep is planned; drop wait=true (jobs status <sweep dir> follows them)"
        )
    if cfg.sweep.array_limit < 0:
        raise ConfigError(f"sweep.array_limit={cfg.sweep.array_limit}: valid: 0 (no limit) or more")
    if width == ARRAY:  # each task holds its point's own nodes and time limit
        return
    if width and nodes > width:
        raise ConfigError(
            f"sweep.pack={width}: this point needs {nodes} nodes; valid: a pack of {nodes}"
            " nodes or more, auto, or off"
        )
    limit = cfg.sweep.pack_time_min
    own = cfg.machine.slurm.limit_min(nodes)
    if limit is not None and (limit < 1 or own > limit):
        raise ConfigError(
            f"sweep.pack_time_min={limit}: a pack must hold a point's whole time limit"
            f" ({own} min, machine.slurm.time_min); valid: {own} or more, or null"
        )


@dataclass(frozen=True)
class Point:
    """A packed point as the sweep registers it: what planning and the pack's run need."""

    num: int
    job_dir: str
    nodes: int
    tasks_per_node: int
    minutes: int  # its own time limit: the longest it may run
    header: tuple[str, ...]  # its #SBATCH lines that a pack must share (``shared_header``)
    width: int = 0  # sweep.pack: the pack's nodes (0: auto)
    # the pack's time limit: sweep.pack_time_min, else the machine's for the pack's nodes
    limits: dict = field(default_factory=dict)  # pack_time_min, time_min, time_bins
    params: dict = field(default_factory=dict)  # submitit's parameters (the step's shape)
    dry_run: bool = False
    recovery: bool = False  # an array task: its recovery job is chained (recovery.sh)

    @staticmethod
    def of(entry: dict) -> Point:
        return Point(**{**entry, "header": tuple(entry["header"])})

    def pack_limit(self, width: int) -> int:
        """The time limit of a pack of ``width`` nodes holding this point."""
        limits = self.limits
        if limits.get("pack_time_min"):
            return int(limits["pack_time_min"])
        bins = limits.get("time_bins") or []
        return SlurmSettings(time_min=limits.get("time_min"), time_bins=bins).limit_min(width)

    def group(self) -> str:
        """What points must share to share a pack: batch options, width and limits."""
        return json.dumps([self.header, self.width, self.limits, self.dry_run], sort_keys=True)


def point_of(cfg: LaunchConfig, job_dir: Path, nodes: int, tasks_per_node: int,
             script: str, params: dict, *, recovery: bool = False) -> Point:  # fmt: skip
    """The packed point of ``cfg``'s launch: its shape, shared options and limits."""
    _, num = sweep_point()
    slurm, width = cfg.machine.slurm, width_of(cfg) or 0
    limits = {"pack_time_min": cfg.sweep.pack_time_min, "time_min": slurm.time_min,
              "time_bins": slurm.time_bins, "array_limit": cfg.sweep.array_limit}  # fmt: skip
    header = array_header(script) if width == ARRAY else shared_header(script)
    return Point(num=num, job_dir=str(job_dir), nodes=nodes, tasks_per_node=tasks_per_node,
                 minutes=slurm.limit_min(nodes), header=header, width=width, limits=limits,
                 params=params, dry_run=cfg.dry_run, recovery=recovery)  # fmt: skip


def shared_header(script: str) -> tuple[str, ...]:
    """The ``#SBATCH`` lines of a point's batch script that its pack keeps: all but those
    a pack sets itself (``PACK_OWN``). Points with the same lines may share a pack."""
    kept = []
    for line in script.split("\n"):
        option = line.removeprefix("#SBATCH --").partition("=")[0]
        if line.startswith("#SBATCH --") and option not in PACK_OWN:
            kept.append(line)
    return tuple(kept)


ARRAY_OWN = ("job-name", "output", "error")  # what an array sets itself for its tasks


def array_header(script: str) -> tuple[str, ...]:
    """A point's ``#SBATCH`` lines that its job array keeps: all but its name and logs. So
    only points of one shape (nodes, time, ...) share an array."""
    return tuple(
        line
        for line in script.split("\n")
        if line.startswith("#SBATCH --")
        and line.removeprefix("#SBATCH --").partition("=")[0] not in ARRAY_OWN
    )


def sweep_point() -> tuple[Path, int]:
    """The running multirun's sweep dir and this point's number."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    return Path(hydra.sweep.dir).resolve(), int(hydra.job.num)


def register(point: Point, sweep_dir: Path) -> Path:
    """Write the point's entry where ``submit_packs`` finds it."""
    path = sweep_dir / PACKS / PACK_PENDING / f"{point.num}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(point), indent=2) + "\n")
    return path


# --- planning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pack:
    """One allocation: its nodes and minutes, and each point with its planned start."""

    nodes: int
    minutes: int
    points: tuple[Point, ...]
    starts: tuple[int, ...]  # minutes after the pack starts, at the latest


def plan(points: list[Point], width: int, limit: int) -> list[Pack]:
    """Points into packs of at most ``width`` nodes and ``limit`` minutes, each point
    running for at most its own ``minutes``: the largest first, each at the earliest time a
    pack has its nodes free (first fit), a new pack when none has. Each pack then shrinks
    to the nodes and minutes its points use."""
    packs: list[Slots] = []
    for point in sorted(points, key=lambda p: (-p.nodes, -p.minutes, p.num)):
        if point.nodes > width or point.minutes > limit:
            raise ValueError(f"point {point.num} does not fit a pack of {width} x {limit}")
        for slots in packs:
            if slots.place(point, width, limit):
                break
        else:
            packs.append(Slots())
            packs[-1].place(point, width, limit)
    return [slots.pack() for slots in packs]


@dataclass
class Slots:
    """One pack while it is planned: its points with their starts, and the nodes in use
    per (start, minutes) interval (few distinct ones, however many points)."""

    placed: list[tuple[int, Point]] = field(default_factory=list)
    use: dict[tuple[int, int], int] = field(default_factory=dict)

    def place(self, point: Point, width: int, limit: int) -> bool:
        """Place ``point`` at the first minute (0 or an interval's end) from which its
        nodes are free until it ends within ``limit``; False if there is none."""
        for start in sorted({0, *(s + m for s, m in self.use)}):
            end = start + point.minutes
            if end > limit:
                return False
            if self.peak(start, end) + point.nodes <= width:
                self.placed.append((start, point))
                key = (start, point.minutes)
                self.use[key] = self.use.get(key, 0) + point.nodes
                return True
        return False

    def peak(self, start: int, end: int) -> int:
        """The most nodes in use at once within [start, end)."""
        moments = [start, *(s for s, _ in self.use if start <= s < end)]
        return max(sum(n for (s, m), n in self.use.items() if s <= t < s + m) for t in moments)

    def pack(self) -> Pack:
        ordered = sorted(self.placed, key=lambda sp: (sp[0], sp[1].num))
        nodes = max(self.peak(s, s + 1) for s, _ in self.use)
        minutes = max(s + m for s, m in self.use)
        return Pack(nodes, minutes, tuple(p for _, p in ordered), tuple(s for s, _ in ordered))


def auto_width(points: list[Point], limit_of, most: int | None = None) -> tuple[int, int]:
    """``sweep.pack=auto``: the pack width (and its limit, ``limit_of(nodes)``) with the
    fewest packs, and of those the fewest nodes, among multiples of the largest point up
    to every point at once, and never beyond ``most`` nodes (the partition's); searched by
    halves, as more nodes never need more packs."""
    largest, total = max(p.nodes for p in points), sum(p.nodes for p in points)
    most = total if most is None else max(min(most, total), largest)
    widths = sorted({min(w, most) for w in range(largest, most + largest, largest)})

    def count(width: int) -> float:
        try:
            return len(plan(points, width, limit_of(width)))
        except ValueError:  # a point longer than this width's limit
            return float("inf")

    fewest = count(widths[-1])
    if fewest == float("inf"):
        raise ValueError("no pack width holds every point within its time limit")
    low, high = 0, len(widths) - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if count(widths[middle]) <= fewest else (middle + 1, high)
    return widths[low], limit_of(widths[low])


# --- the partition's size and limits -------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """What Slurm lets one job of a partition hold: nodes and minutes (None: no limit)."""

    name: str
    nodes: int
    max_minutes: int | None = None


def partition_of(header: tuple[str, ...] | list[str]) -> str:
    """The partition a point's ``#SBATCH`` lines name ('' for the cluster's default)."""
    found = [line.partition("=")[2] for line in header if line.startswith("#SBATCH --partition=")]
    return found[-1].strip("'\"") if found else ""


_PARTITIONS: dict[str, Partition | None] = {}


def partition_limits(name: str) -> Partition | None:
    """The partition's nodes (its size, or MaxNodes if smaller) and MaxTime, from
    ``scontrol show partition -o`` (the default partition for ''); None if Slurm does
    not say. Asked once per process."""
    if name not in _PARTITIONS:
        _PARTITIONS[name] = parse_partitions(SLURM.partition_text(name), name)
    return _PARTITIONS[name]


def parse_partitions(text: str, name: str = "") -> Partition | None:
    """The partition ``name`` (the default one for '') of ``scontrol show partition -o``."""
    for line in text.splitlines():
        fields = dict(f.partition("=")[::2] for f in line.split())
        if (name and fields.get("PartitionName") != name) or (
            not name and fields.get("Default") != "YES"
        ):
            continue
        if not fields.get("TotalNodes", "").isdigit():
            return None
        nodes = int(fields["TotalNodes"])
        if fields.get("MaxNodes", "").isdigit():
            nodes = min(nodes, int(fields["MaxNodes"]))
        return Partition(fields["PartitionName"], nodes, slurm_minutes(fields.get("MaxTime", "")))
    return None


def slurm_minutes(text: str) -> int | None:
    """Minutes of a Slurm time (``[D-]HH:MM:SS``, ``MM``); None for UNLIMITED or unknown."""
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = clock.split(":")
    if not days.isdigit() or not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    hours, minutes = (int(parts[0]), int(parts[1])) if len(parts) == 3 else (0, int(parts[0]))
    return int(days) * 1440 + hours * 60 + minutes


def fitting(group: list[Point], partition: Partition | None) -> str:
    """Why the group's packs cannot fit ``partition`` (one line), or ''."""
    if partition is None:
        return ""
    first, where = group[0], f"partition {partition.name} has {partition.nodes} nodes"
    largest = max(group, key=lambda p: p.nodes)
    if largest.nodes > partition.nodes:
        return (
            f"point {largest.num} needs {largest.nodes} nodes; {where}; valid: a larger partition"
        )
    if first.width > partition.nodes:
        return (f"sweep.pack={first.width}: {where}, so a pack of {first.width} nodes could never"
                f" start; valid: {partition.nodes} or fewer, or auto")  # fmt: skip
    longest = max(group, key=lambda p: p.minutes)
    if partition.max_minutes is not None and longest.minutes > partition.max_minutes:
        return (f"point {longest.num} needs {longest.minutes} min; partition {partition.name}"
                f" allows {partition.max_minutes} min; valid: machine.slurm.time_min of at most"
                f" {partition.max_minutes}")  # fmt: skip
    return ""


def capped(limit_of, partition: Partition | None):
    """``limit_of`` (minutes of a pack of that many nodes) within the partition's MaxTime."""
    if partition is None or partition.max_minutes is None:
        return limit_of
    return lambda width: min(limit_of(width), partition.max_minutes)


# --- submitting the packs (at the end of the sweep) -------------------------------------------


def pending(sweep_dir: Path) -> list[Point]:
    folder = sweep_dir / PACKS / PACK_PENDING
    found = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if folder.is_dir() else []
    return [Point.of(json.loads(path.read_text())) for path in found]


def groups(points: list[Point]) -> list[list[Point]]:
    """Points that may share an allocation (``Point.group``)."""
    found: dict[str, list[Point]] = {}
    for point in points:
        found.setdefault(point.group(), []).append(point)
    return list(found.values())


def pack_script(pack: Pack, folder: Path, name: str) -> str:
    """The pack's batch script: its points' shared options, its own size, time and log,
    ``--no-kill`` (a lost node ends only the points on it), and the pack's run."""
    own = [f"--job-name={shlex.quote(name)}", f"--nodes={pack.nodes}",
           f"--time={pack.minutes}", "--no-kill", "--no-requeue",
           f"--output={shlex.quote(str(folder / PACK_LOG))}"]  # fmt: skip
    command = shlex.join([sys.executable, "-m", "axonn_launch.pack", str(folder)])
    lines = ["#!/bin/bash", *pack.points[0].header, *(f"#SBATCH {o}" for o in own)]
    return "\n".join([*lines, f"exec {command}", ""])


def submit_packs(sweep_dir: Path, *, out) -> list[str]:
    """Plan the sweep's pending points into packs and submit each (``sbatch``; a dry run's
    only written); one line per pack. Each point's job.json and ``points/<num>.json`` then
    name the pack's job."""
    lines, count = [], 0
    for group in groups(pending(sweep_dir)):
        first = group[0]
        if first.width == ARRAY:
            folder = sweep_dir / PACKS / str(count)
            count += 1
            lines.append(submit_array(group, folder, sweep_dir.name, dry_run=first.dry_run))
            continue
        partition = None if first.dry_run else partition_limits(partition_of(first.header))
        why = fitting(group, partition)
        if why:
            lines.append(refuse(group, why, sweep_dir))
            continue
        width, limit_of = first.width, capped(first.pack_limit, partition)
        limit = limit_of(width) if width else 0
        if not width:
            width, limit = auto_width(group, limit_of, partition and partition.nodes)
        if first.dry_run:
            lines.append(DRY_RUN_NOTE)
        for pack in plan(group, width, limit):
            folder = sweep_dir / PACKS / str(count)
            count += 1
            lines.append(submit_pack(pack, folder, sweep_dir.name, dry_run=first.dry_run))
    for line in lines:
        print(line, file=out, flush=True)
    return lines


DRY_RUN_NOTE = ("packs: the partition's size and limits are not checked in a dry run"
                " (scontrol show partition, at submission)")  # fmt: skip


def refuse(group: list[Point], why: str, sweep_dir: Path) -> str:
    """Nothing submitted for ``group``: each point's job.json and row say refused, and why."""
    for point in group:
        update_record(Path(point.job_dir), status="refused", error=why)
        row = sweep_dir / "points" / f"{point.num}.json"
        if row.is_file():
            entry = json.loads(row.read_text())
            entry.update(status="refused", message=why)
            row.write_text(json.dumps(entry, indent=2))
    return (
        f"packs refused, nothing submitted for points {','.join(str(p.num) for p in group)}: {why}"
    )


def submit_pack(pack: Pack, folder: Path, sweep_name: str, *, dry_run: bool) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / PACK_SCRIPT
    script.write_text(pack_script(pack, folder, f"pack-{sweep_name}-{folder.name}"))
    (folder / PACK_PLAN).write_text(json.dumps(plan_record(pack), indent=2) + "\n")
    nums = ",".join(str(p.num) for p in pack.points)
    shape = f"{pack.nodes} nodes x {pack.minutes} min, points {nums}"
    if dry_run:
        return f"pack {folder.name}: {shape} (dry run: {script})"
    job_id, why = sbatch(script, pack.points)
    if why:
        return f"pack {folder.name}: sbatch refused it: {why} ({shape})"
    plan_path = folder / PACK_PLAN
    plan_path.write_text(json.dumps({**plan_record(pack), "job_id": job_id}, indent=2) + "\n")
    for point in pack.points:
        record_submitted(point, job_id, folder)
    return f"pack {folder.name}: job {job_id}, {shape}"


def sbatch(script: Path, points: tuple[Point, ...] | list[Point]) -> tuple[str, str]:
    """Submit ``script``: (its job id, ''), or ('', sbatch's last line) with its points'
    job.json saying refused."""
    job_id, why = SLURM.submit_script(script)
    if job_id:
        return job_id, ""
    for point in points:
        update_record(Path(point.job_dir), status="refused", error=why)
    return "", why


def plan_record(pack: Pack) -> dict:
    return {"nodes": pack.nodes, "minutes": pack.minutes,
            "points": [asdict(p) for p in pack.points], "starts": list(pack.starts)}  # fmt: skip


def record_submitted(point: Point, job_id: str, folder: Path) -> None:
    """The point's job.json names the pack's job; its ``points/<num>.json`` too."""
    update_record(
        Path(point.job_dir), status="submitted", job_ids=[job_id],
        pack={"job_id": job_id, "dir": str(folder)},
    )  # fmt: skip
    row = folder.parent.parent / "points" / f"{point.num}.json"
    if row.is_file():
        entry = json.loads(row.read_text())
        entry.update(status="submitted", job_id=job_id)
        row.write_text(json.dumps(entry, indent=2))


# --- job arrays (sweep.pack=array) -------------------------------------------------------------


def array_script(points: list[Point], folder: Path, name: str) -> str:
    """A job array of ``points`` (one shape): task i runs point i on the task's own nodes
    (``axonn_launch.pack``), at most ``sweep.array_limit`` at once."""
    limit = int(points[0].limits.get("array_limit") or 0)
    tasks = f"0-{len(points) - 1}" + (f"%{limit}" if limit else "")
    own = [f"--job-name={shlex.quote(name)}", f"--array={tasks}",
           f"--output={shlex.quote(str(folder / ARRAY_LOG))}"]  # fmt: skip
    command = shlex.join([sys.executable, "-m", "axonn_launch.pack", str(folder)])
    lines = ["#!/bin/bash", *points[0].header, *(f"#SBATCH {o}" for o in own)]
    return "\n".join([*lines, f"exec {command}", ""])


def submit_array(points: list[Point], folder: Path, sweep_name: str, *, dry_run: bool) -> str:
    """Submit ``points`` as one job array; each point's job id is its task's ``<id>_<i>``,
    with its recovery job chained to it as to a job of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / PACK_SCRIPT
    script.write_text(array_script(points, folder, f"array-{sweep_name}-{folder.name}"))
    record = {"array": True, "points": [asdict(p) for p in points]}
    (folder / PACK_PLAN).write_text(json.dumps(record, indent=2) + "\n")
    shape = f"{len(points)} tasks of {points[0].nodes} node(s), points " + ",".join(
        str(p.num) for p in points
    )
    if dry_run:
        return f"array {folder.name}: {shape} (dry run: {script})"
    job_id, why = sbatch(script, points)
    if why:
        return f"array {folder.name}: sbatch refused it: {why} ({shape})"
    (folder / PACK_PLAN).write_text(json.dumps({**record, "job_id": job_id}, indent=2) + "\n")
    for task, point in enumerate(points):
        record_submitted(point, f"{job_id}_{task}", folder)
        if point.recovery:
            recovery = chain.sbatch_recovery(Path(point.job_dir), f"{job_id}_{task}")
            update_record(Path(point.job_dir), recovery_job=recovery)
    return f"array {folder.name}: job {job_id}, {shape}"
