"""DCP's save plan at the paper's scale, on its coordinator (issue 46: "DCP's plan and
``.metadata`` at 32,768 ranks: the coordinator's memory and the file's size").

The job is gpt_320b on Frontier's 4,096 nodes (32,768 ranks), as the launcher's dry run
plans it (its spec.json: the grid and the model). Rank 0 builds its model at the real
shapes with the first ``L`` of its blocks (torch's fake process group at the full world
size), which gives every parameter's layout. Then every rank's local save plan is made as
``ShardSavePlanner`` makes it, from that rank's own pieces (``shard_spec`` at its grid
position; no tensor of another rank is allocated): the weights' and both moments' pieces
on the replica that writes, and the plain keys (each parameter's AdamW step count, the
rank's loader and rng bytes, the meta string). The coordinator's part is then
``create_global_plan`` (deduplication, the global plan and metadata, the merge of the
ranks' key maps, the validation), and ``.metadata`` is the pickle of that metadata with
the storage entry a file system writer records for each item.

Measured at ``--blocks`` (default: 1, about 6 minutes here; each more block adds its
items), each twice: "before" (DCP's: every rank plans the step counts and the meta string,
as DCP does with a plain key, and its ``create_global_plan`` merges the key maps with a
``ChainMap``) and "after" (``ShardSavePlanner``'s: the coordinator alone plans them, and
the maps are merged in one pass). Reported: the items the coordinator receives and keeps,
its peak memory (its peak RSS above what it held before: the received plans, the global
plan and the pickle), its time and the file's size. With two or more ``--blocks``, the
whole model's figures are extrapolated linearly in the blocks.

    python bench/scale/dcp_plan.py   # bench/results/dcp_plan.json and .md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlan  # noqa: E402

from axonn_launch.common.spec import JobSpec  # noqa: E402
from axonn_launch.train.checkpoint.state import moment_key, rank_key, step_key  # noqa: E402
from axonn_launch.train.models.adamw import MOMENTS  # noqa: E402
from axonn_launch.train.parallel.groups import Groups, build_groups  # noqa: E402
from axonn_launch.train.parallel.shards import ShardSavePlanner, _write_item, shard_spec  # noqa: E402
from axonn_launch.train.rehearse.rank import (  # noqa: E402
    job_model,
    join_fake_world,
    rank_env,
    reset_peak,
    status_bytes,
)

RESULTS = ROOT / "bench" / "results"
POINT = ["machine=frontier", "model=gpt_320b", "nodes=4096"]
BLOCKS = (1,)
COMMAND = "python bench/scale/dcp_plan.py"
LABELS = {
    "before": "before: DCP's (every rank plans the same keys; ChainMap merge)",
    "after": "after: ShardSavePlanner's (the coordinator plans them; one-pass merge)",
}


def job_spec(work: Path) -> JobSpec:
    """The spec the launcher's dry run writes for the point (login wing, no torch)."""
    job_dir = work / "job"
    subprocess.run([sys.executable, "-m", "axonn_launch", *POINT, "dry_run=true",
                    f"hydra.run.dir={job_dir}"], check=True, capture_output=True,
                   timeout=300, cwd=work)  # fmt: skip
    return JobSpec.from_json((job_dir / "spec.json").read_text())


def layouts(spec: JobSpec, blocks: int) -> dict:
    """Each parameter's layout, from rank 0's model with the first ``blocks`` blocks."""
    model_spec = dataclasses.replace(spec.model, n_layer=blocks)
    spec = dataclasses.replace(spec, model=model_spec)
    env = rank_env(0, spec.grid.world_size, 8)  # Frontier: 8 GCDs per node
    model = job_model(spec, env, build_groups(spec.grid, rank=0))
    found = {name: p.shard_layout for name, p in model.named_parameters()}
    del model
    return found


def position(grid, rank: int) -> Groups:
    """A rank's place in the grid, without its process groups (all a plan reads)."""
    return Groups(grid=grid, rank=rank, coords=grid.coords(rank),
                  x=None, y=None, z=None, data=None, plane=None)  # fmt: skip


def local_plan(grid, rank: int, found: dict, coordinator_steps: bool) -> SavePlan:
    """Rank ``rank``'s local plan, as its ``ShardSavePlanner`` makes it."""
    groups, items = position(grid, rank), []
    for name, layout in found.items() if groups.coords.data == 0 else ():  # only they write
        spec = shard_spec(layout, groups, 4, banded=True)
        if spec.writes:
            for key in (name, *(moment_key(name, m) for m in MOMENTS)):
                items += [_write_item(key, p, spec.full_shape, torch.float32) for p in spec.pieces]
    plain: dict[str, object] = {rank_key(rank): b"\0" * 64}
    if rank == 0 or not coordinator_steps:
        plain.update({step_key(name): torch.tensor(1.0) for name in found})
        plain["meta"] = "{}"
    items += create_default_local_save_plan(plain, rank == 0).items
    return SavePlan(items, planner_data={key: (key,) for key in {i.index.fqn for i in items}})


def coordinator(grid, found: dict, fixed: bool) -> dict:
    """Every rank's plan as the coordinator receives them, then DCP's global plan, metadata
    and the pickled file: items, seconds, peak memory, bytes."""
    gc.collect()
    resets = reset_peak()
    baseline = status_bytes("VmRSS")
    began = time.perf_counter()
    plans = [local_plan(grid, r, found, fixed) for r in range(grid.world_size)]
    planned = time.perf_counter()
    received = sum(len(p.items) for p in plans)
    planner = ShardSavePlanner({})  # DCP's own global plan before, this one's after
    merge = ShardSavePlanner.create_global_plan if fixed else DefaultSavePlanner.create_global_plan
    global_plan, metadata = merge(planner, plans)
    merged = time.perf_counter()
    storage = {}
    for rank, plan in enumerate(global_plan):
        offset = 0
        for item in plan.items:
            length = 4 if item.tensor_data is None else 4 * item.tensor_data.chunk.sizes.numel()
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    metadata.storage_data = storage
    size = len(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
    peak = status_bytes("VmHWM") - baseline if resets else None
    kept, entries = sum(len(p.items) for p in global_plan), len(storage)
    del plans, global_plan, metadata, storage
    return {
        "items_received": received,
        "items_kept": kept,
        "metadata_entries": entries,
        "metadata_bytes": size,
        "coordinator_peak_rss_bytes": peak,
        "local_plans_s": planned - began,
        "global_plan_s": merged - planned,
    }


def fit_line(xs: list[int], ys: list[float], at: int) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my + slope * (at - mx)


def markdown(result: dict) -> str:
    rows = ["| blocks | plan | items the coordinator receives | items kept |"
            " .metadata entries | .metadata MB | coordinator peak RSS MB | global plan s |"
            " local plans s (all ranks, here) |", "|---" * 9 + "|"]  # fmt: skip
    for point in result["points"]:
        for mode in ("before", "after"):
            m = point[mode]
            label = LABELS[mode]
            rows.append(
                f"| {point['blocks']} | {label} | {m['items_received']:,} |"
                f" {m['items_kept']:,} | {m['metadata_entries']:,} |"
                f" {m['metadata_bytes'] / 1e6:,.1f} |"
                f" {m['coordinator_peak_rss_bytes'] / 1e6:,.0f} |"
                f" {m['global_plan_s']:.1f} | {m['local_plans_s']:.1f} |"
            )
    full = result["full_model"]
    if full is None:
        return "\n".join(["# DCP's save plan at 32,768 ranks: the coordinator and .metadata", "",
                          f"Script: bench/scale/dcp_plan.py (`{COMMAND}`)", "", intro(result),
                          "", *rows, ""])  # fmt: skip
    rows += ["", f"The whole model ({result['n_layer']} blocks), extrapolated linearly in the"
             " blocks from the rows above:", "",
             "| plan | items received | .metadata MB | coordinator peak RSS MB |"
             " global plan s |", "|---|---|---|---|---|"]  # fmt: skip
    for mode, label in LABELS.items():
        f = full[mode]
        rows.append(
            f"| {label} | {f['items_received']:,.0f} |"
            f" {f['metadata_bytes'] / 1e6:,.0f} |"
            f" {f['coordinator_peak_rss_bytes'] / 1e6:,.0f} | {f['global_plan_s']:,.0f} |"
        )
    return "\n".join(["# DCP's save plan at 32,768 ranks: the coordinator and .metadata", "",
                      f"Script: bench/scale/dcp_plan.py (`{COMMAND}`)", "", intro(result), "",
                      *rows, ""])  # fmt: skip


def intro(result: dict) -> str:
    return (
        f"gpt_320b on {result['nodes']:,} Frontier nodes, {result['world_size']:,} ranks, grid"
        f" {result['grid']} (the launcher's dry run), its first block(s) of"
        f" {result['n_layer']}. Measured: every rank's local save plan made from its own pieces"
        " at the real shapes, then the coordinator's work (`create_global_plan`: DCP's own"
        " before, `ShardSavePlanner`'s after) and the pickled `.metadata`, in one process on"
        f" {result['host']}, {result['when']}. Before: every rank plans the step counts and"
        " the meta string, and DCP merges the ranks' key maps with a ChainMap. After: the"
        " coordinator alone plans them, and the maps are merged in one pass."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    parser.add_argument("--out", type=Path, default=RESULTS / "dcp_plan.json")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    spec = job_spec(Path(tempfile.mkdtemp(prefix="axonn-dcp-plan-")))
    grid = spec.grid
    join_fake_world(0, grid.world_size)
    print(f"{time.perf_counter() - began:.0f} s: the spec, grid {grid.describe()}", flush=True)
    points = []
    for blocks in args.blocks:
        found = layouts(spec, blocks)
        print(f"{time.perf_counter() - began:.0f} s: {len(found)} layouts", flush=True)
        point = {"blocks": blocks, "parameters": len(found)}
        for mode, fixed in (("before", False), ("after", True)):
            point[mode] = coordinator(grid, found, fixed)
            print(blocks, mode, json.dumps(point[mode]), flush=True)
        points.append(point)
    xs = [p["blocks"] for p in points]
    full = None  # one block measured: no line to extrapolate along
    if len(xs) > 1:
        full = {mode: {key: fit_line(xs, [p[mode][key] for p in points], spec.model.n_layer)
                       for key in points[0][mode]} for mode in ("before", "after")}  # fmt: skip
    result = {
        "label": "measured: the plans and the coordinator's work in one process; the whole"
        " model: extrapolated linearly in the blocks",
        "command": COMMAND, "host": f"{os.uname().nodename} {os.cpu_count()} CPUs",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nodes": 4096, "world_size": grid.world_size, "grid": grid.describe(),
        "n_layer": spec.model.n_layer, "points": points, "full_model": full,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
