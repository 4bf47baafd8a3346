"""Group creation at 32,768 ranks, per rank, with torch's fake process group (issue 46,
part 5: <= 10 s per rank): ``train/parallel/groups.build_groups`` as it is against its
options, each in a fresh process for one rank.

- ``as_is``: ``build_groups``: every rank calls ``new_group`` for every group of the grid.
- ``own_local_sync``: each rank calls ``new_group(ranks, use_local_synchronization=True)``
  for its own groups only (the same axes, the second z group and the world): torch's way to
  skip the groups a rank is not in (non-members need not call; the group's name is a hash
  of its ranks, so the members agree without a global counter).
- ``all_local_sync``: every group, with ``use_local_synchronization=True`` (a non-member's
  call returns at once); a few runs, no ratio claimed.
- ``enumerate_only``: only the grid's rank lists, as ``build_groups`` makes them (the part
  of ``as_is`` spent in ``common/grid.py``); a few runs, no ratio claimed.
- ``split_group``: torch's ``split_group`` (NCCL's comm split) refuses a parent group
  without an accelerator backend that splits: not measurable here; recorded as such.

The fake backend creates no communicator: NCCL/RCCL's own cost per group (and what a comm
split saves of it) is not in these figures, only torch's Python and C++ side.
``python bench/bench_groups.py [--pairs 10]`` prints the table and writes
bench/results/bench_groups.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import MIN_PAIRS, interleaved, load_line, load_now, quartiles, ratios  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GRIDS = {  # (data, x, y, z)
    "issue": (64, 2, 2, 128),  # the issue's example: about 42,000 new_group calls per rank
    "gpt_320b_frontier_4096": (2, 8, 16, 128),  # the planner's grid (dry run of that point)
}
RANK = 12345
SINGLE_OPTIONS = ("all_local_sync", "enumerate_only")  # a few runs each, no ratio claimed
SINGLES = 3


def one(option: str, grid: tuple[int, int, int, int], rank: int) -> dict:
    """In this process: join a fake world of the grid's size and create its groups."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from axonn_launch.common.grid import Grid
    from axonn_launch.train.parallel.groups import build_groups

    g = Grid(data=grid[0], x=grid[1], y=grid[2], z=grid[3])
    dist.init_process_group("fake", rank=rank, world_size=g.world_size, store=FakeStore())
    before = dist.distributed_c10d._world.group_count
    started = time.perf_counter()
    if option == "as_is":
        build_groups(g, rank=rank)
    elif option == "enumerate_only":  # the grid's lists alone, as build_groups makes them
        all_group_lists(g)
    elif option == "split_group":
        try:
            dist.split_group(split_ranks=g.groups("z"))
        except RuntimeError as error:
            return {"option": option, "seconds": None, "error": str(error).splitlines()[0]}
    else:
        calls = local_sync_groups(g, rank, own_only=option == "own_local_sync")
        seconds = time.perf_counter() - started
        return {"option": option, "seconds": seconds, "new_group_calls": calls}
    seconds = time.perf_counter() - started
    calls = dist.distributed_c10d._world.group_count - before  # one per new_group call
    return {"option": option, "seconds": seconds, "new_group_calls": calls}


def local_sync_groups(g, rank: int, *, own_only: bool) -> int:
    """Every group of the grid with ``use_local_synchronization``; with ``own_only`` only
    this rank's, their members computed from its coordinates (``own_groups``)."""
    import torch.distributed as dist

    world = [list(range(g.world_size))]
    lists = [own_groups(g, rank)] if own_only else [*all_group_lists(g), world]
    calls = 0
    for rank_lists in lists:
        for ranks in rank_lists:
            dist.new_group(ranks, use_local_synchronization=True)
            calls += 1
    return calls


def all_group_lists(g) -> list[list[list[int]]]:
    """Every group of each axis longer than 1, as ``build_groups`` enumerates them."""
    lists = [g.groups(a) for a in ("x", "y", "z", "data")] + [g.plane_groups(), g.groups("z")]
    return [rank_lists for rank_lists in lists if len(rank_lists[0]) > 1]


def own_groups(g, rank: int) -> list[list[int]]:
    """This rank's group along each axis (x fastest, then y, z, data), the x*y plane, a
    second z group and the world: O(members) arithmetic, no enumeration of the grid."""
    c = g.coords(rank)
    strides = {"x": 1, "y": g.x, "z": g.x * g.y, "data": g.x * g.y * g.z}
    out = []
    for axis in ("x", "y", "z", "data"):
        size, stride = getattr(g, axis), strides[axis]
        if size > 1:
            base = rank - getattr(c, axis) * stride
            out.append([base + i * stride for i in range(size)])
    if g.x * g.y > 1:
        base = rank - (c.x + g.x * c.y)
        out.append(list(range(base, base + g.x * g.y)))
    if g.z > 1:
        out.append(out[[a for a in ("x", "y", "z") if getattr(g, a) > 1].index("z")])
    return [*out, list(range(g.world_size))]


def run_one(option: str, grid_name: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", option, "--grid", grid_name],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(on: str, off: str, grid_name: str, pairs: int) -> dict:
    """``pairs`` interleaved pairs of two options: the seconds of each, and on/off - 1."""
    seen: dict[str, list[dict]] = {on: [], off: []}

    def arm(option: str):
        def timed(_: int) -> float:
            seen[option].append(run_one(option, grid_name))
            return seen[option][-1]["seconds"]

        return timed

    measured = interleaved(arm(on), arm(off), pairs)
    q1, median, q3 = quartiles(ratios(measured))
    return {
        "grid": grid_name, "on": on, "off": off, "pairs": measured,
        "calls": {on: seen[on][0]["new_group_calls"], off: seen[off][0]["new_group_calls"]},
        "median_s": {k: quartiles([p[k] for p in measured])[1] for k in ("on", "off")},
        "ratio_minus_1": {"q1": q1, "median": median, "q3": q3},
    }  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        "# Group creation at 32,768 ranks: build_groups and its options",
        "",
        "Script: bench/bench_groups.py (`python bench/bench_groups.py --pairs"
        f" {result['pairs']}`). Each option in a fresh process for rank {result['rank']};"
        " issue 46's goal: <= 10 s per rank.",
        "",
        "| grid (data, x, y, z) | option | new_group calls | median s per rank |",
        "|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        grid = GRIDS[c["grid"]]
        for key in ("off", "on"):
            lines.append(
                f"| {grid} | {c[key]} | {c['calls'][c[key]]:,} | {c['median_s'][key]:.3f} |"
            )
        r = c["ratio_minus_1"]
        lines.append(
            f"| {grid} | {c['on']} / {c['off']} - 1 | | {r['median']:+.1%}"
            f" (IQR {r['q1']:+.1%} .. {r['q3']:+.1%}, {len(c['pairs'])} pairs) |"
        )
    for option, runs in result["singles"].items():
        median = quartiles([r["seconds"] for r in runs])[1]
        calls = runs[0]["new_group_calls"]
        lines.append(
            f"| {GRIDS['issue']} | {option} | {calls:,} | {median:.3f} ({len(runs)} runs, median) |"
        )
    split = result["split_group"]
    lines += [
        "",
        f"split_group: not measurable here ({split['error']}).",
        "Measured on one real rank with torch's fake process group: no communicator is"
        " created, so NCCL/RCCL's per-group cost is not in these figures.",
        result["load"],
        f"Made by `python bench/bench_groups.py --pairs {result['pairs']}`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", help="run one option in this process and print its JSON")
    parser.add_argument("--grid", default="issue", choices=sorted(GRIDS))
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS)
    parser.add_argument(
        "--markdown-only", action="store_true", help="rewrite the .md from the .json"
    )
    args = parser.parse_args()
    if args.markdown_only:
        result = json.loads((RESULTS / "bench_groups.json").read_text())
        (RESULTS / "bench_groups.md").write_text(markdown(result))
        return 0
    if args.one:
        print(json.dumps(one(args.one, GRIDS[args.grid], RANK)))
        return 0
    before = load_now()
    comparisons = [
        compare("own_local_sync", "as_is", "issue", args.pairs),
        compare("own_local_sync", "as_is", "gpt_320b_frontier_4096", args.pairs),
    ]
    singles = {o: [run_one(o, "issue") for _ in range(SINGLES)] for o in SINGLE_OPTIONS}
    result = {
        "comparisons": comparisons,
        "singles": singles,
        "split_group": run_one("split_group", "issue"),
        "pairs": args.pairs,
        "rank": RANK,
        "label": "measured on one real rank with fake collectives",
        "load": load_line(before, load_now()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_groups.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "bench_groups.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
