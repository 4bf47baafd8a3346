"""Planning packed sweeps (``submit/pack.py``): points into allocations within their width
and time limit, the width ``sweep.pack=auto`` picks over a site's time bins, and the login
node's one-line refusals. The packed sweep itself runs in tests/slurm/test_packed_sweep.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from axonn_launch.common.machine import SlurmSettings
from axonn_launch.config.compose import ConfigError, load
from axonn_launch.submit import allocation
from axonn_launch.submit.pack import (
    Pack,
    Point,
    array_header,
    array_script,
    auto_width,
    check,
    plan,
    shared_header,
)
from tests.conftest import run_launcher
from tests.fake_slurm import failing, fake_tools, on_path

FRONTIER_BINS = [[91, 120], [183, 360], [9472, 720]]  # conf/machine/frontier.yaml


def points(*shapes: tuple[int, int], root: str = "/j") -> list[Point]:
    return [
        Point(
            num=n, job_dir=f"{root}/{n}", nodes=nodes, tasks_per_node=8, minutes=minutes, header=()
        )
        for n, (nodes, minutes) in enumerate(shapes)
    ]


def nums(pack: Pack) -> list[int]:
    return sorted(p.num for p in pack.points)


def check_fits(packs: list[Pack], width: int, limit: int, count: int) -> None:
    """Every point once; no pack over its nodes at any moment, nor past its minutes."""
    assert sorted(n for pack in packs for n in nums(pack)) == list(range(count))
    for pack in packs:
        assert pack.nodes <= width and pack.minutes <= limit
        placed = list(zip(pack.starts, pack.points))
        for start, point in placed:
            assert start + point.minutes <= pack.minutes
            used = sum(p.nodes for s, p in placed if s <= start < s + p.minutes)
            assert used <= pack.nodes, (start, used, pack)


def test_six_one_node_points_fill_a_four_node_pack_then_a_second_of_two():
    packs = plan(points(*[(1, 10)] * 6), width=4, limit=10)
    assert [(p.nodes, p.minutes, nums(p)) for p in packs] == [
        (4, 10, [0, 1, 2, 3]),
        (2, 10, [4, 5]),
    ]


def test_a_longer_pack_starts_later_points_as_earlier_ones_end():
    (pack,) = plan(points(*[(1, 10)] * 6), width=4, limit=20)
    assert (pack.nodes, pack.minutes) == (4, 20)
    assert sorted(pack.starts) == [0, 0, 0, 0, 10, 10]


def test_mixed_sizes_are_placed_largest_first_and_each_pack_shrinks_to_its_use():
    packs = plan(points((2, 10), (1, 10), (2, 10), (1, 10), (1, 10)), width=4, limit=10)
    assert [(p.nodes, nums(p)) for p in packs] == [(4, [0, 2]), (3, [1, 3, 4])]


def test_random_sweeps_never_overfill_a_pack():
    rng = random.Random(7)
    for _ in range(200):
        shapes = [
            (rng.choice([1, 2, 4]), rng.choice([5, 10, 30])) for _ in range(rng.randint(1, 12))
        ]
        width, limit = rng.choice([4, 6, 8]), rng.choice([30, 60])
        check_fits(plan(points(*shapes), width, limit), width, limit, len(shapes))


def test_a_point_larger_than_the_pack_is_refused():
    with pytest.raises(ValueError, match="point 0 does not fit a pack of 2 x 10"):
        plan(points((4, 10)), width=2, limit=10)


def test_auto_packs_200_frontier_points_into_one_allocation_of_the_fewest_nodes():
    """200 points of 16 nodes for 2 h each: with the 12 h bin from 184 nodes on, six waves
    fit one allocation; 34 points at once (544 nodes) is the narrowest that holds all 200
    (33 at once hold 198)."""
    bins = SlurmSettings(time_min=None, time_bins=FRONTIER_BINS)
    sweep = points(*[(16, 120)] * 200)
    width, limit = auto_width(sweep, bins.limit_min)
    assert (width, limit) == (544, 720)
    (pack,) = plan(sweep, width, limit)
    assert (pack.nodes, pack.minutes) == (544, 720)
    assert len(plan(sweep, 528, 720)) == 2


def test_the_shared_header_leaves_out_what_a_pack_sets_itself():
    script = "\n".join([
        "#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --time=10", "#SBATCH --partition=wide",
        "#SBATCH --job-name=a", "#SBATCH --output=/x/%j.out", "#SBATCH --no-kill",
        "#SBATCH --exclude=n1", "srun true",
    ])  # fmt: skip
    assert shared_header(script) == ("#SBATCH --partition=wide", "#SBATCH --exclude=n1")


def test_a_job_array_keeps_its_points_shape_and_runs_at_most_its_limit_at_once(tmp_path):
    lines = ["#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --time=10", "#SBATCH --job-name=a",
             "#SBATCH --output=/x/%j.out", "srun true"]  # fmt: skip
    script = "\n".join(lines)
    header = array_header(script)
    assert header == ("#SBATCH --nodes=2", "#SBATCH --time=10")  # one shape per array
    three = [Point(num=n, job_dir=f"/j/{n}", nodes=2, tasks_per_node=4, minutes=10,
                   header=header, limits={"array_limit": 2}) for n in range(3)]  # fmt: skip
    text = array_script(three, tmp_path, "array-s-0")
    assert "#SBATCH --array=0-2%2\n" in text and "#SBATCH --nodes=2\n" in text
    assert text.rstrip().endswith(f"-m axonn_launch.pack {tmp_path}")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["machine=slurm_local", "sweep.pack=two"],
         "sweep.pack='two': valid: off, auto, array, or a node count >= 1"),
        (["machine=slurm_local", "sweep.pack=array", "sweep.array_limit=-1"],
         "sweep.array_limit=-1: valid: 0 (no limit) or more"),
        (["machine=slurm_local", "sweep.pack=1", "grid.x=4"],
         "sweep.pack=1: this point needs 2 nodes; valid: a pack of 2 nodes or more, auto, or off"),
        (["machine=slurm_local", "sweep.pack=4", "sweep.pack_time_min=5"],
         "sweep.pack_time_min=5: a pack must hold a point's whole time limit (10 min,"
         " machine.slurm.time_min); valid: 10 or more, or null"),
        (["machine=slurm_local", "sweep.pack=4", "wait=true"],
         "sweep.pack=4 with wait=true: packed points start when the whole sweep is planned;"
         " drop wait=true (jobs status <sweep dir> follows them)"),
    ],
)  # fmt: skip
def test_the_login_node_refuses_a_pack_that_cannot_run_in_one_line(monkeypatch, args, line):
    monkeypatch.setattr(allocation, "sweeping", lambda: True)  # as in a multirun's point
    cfg = load(args)
    nodes = 2 if "grid.x=4" in args else 1  # slurm_local: 2 tasks per node
    with pytest.raises(ConfigError) as error:
        check(cfg, nodes)
    assert str(error.value) == line


def test_a_packed_sweep_on_a_machine_without_slurm_is_refused_and_nothing_is_packed(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_launcher(
        ["-m", "sweep.pack=4", "train.seed=1,2", "dry_run=true", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    line = ("sweep.pack=4: machine=local has no Slurm allocation to pack points into; valid:"
            " off, or a Slurm machine")  # fmt: skip
    assert line in proc.stdout + proc.stderr
    assert not (sweep_dir / "packs").exists()


def test_a_pack_sbatch_refuses_leaves_each_point_refused_with_its_line(tmp_path, monkeypatch):
    from axonn_launch.common.jobdir import read_record, write_record_file
    from axonn_launch.submit.pack import submit_pack

    fake = fake_tools(tmp_path / "bin", {"sbatch": failing("sbatch: error: invalid partition")})
    monkeypatch.setenv("PATH", on_path(fake))
    two = points((1, 10), (1, 10), root=str(tmp_path / "j"))
    for point in two:
        Path(point.job_dir).mkdir(parents=True)
        write_record_file(point.job_dir, {"job_ids": [], "status": "packed"})
    (pack,) = plan(two, width=2, limit=10)
    line = submit_pack(pack, tmp_path / "packs" / "0", "s", dry_run=False)
    assert line == ("pack 0: sbatch refused it: sbatch: error: invalid partition"
                    " (2 nodes x 10 min, points 0,1)")  # fmt: skip
    for point in two:
        assert read_record(point.job_dir)["status"] == "refused"


# --- packs that fit their partition ----------------------------------------------------------

SCONTROL = (  # `scontrol show partition -o` of the local cluster, with limits set on `wide`
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED"
    " Nodes=n[1-2] State=UP TotalCPUs=16 TotalNodes=2\n"
    "PartitionName=wide AllowGroups=ALL MaxNodes=3 MaxTime=1-02:30:00 Nodes=n[1-4]"
    " State=UP TotalCPUs=32 TotalNodes=4\n"
)


def test_the_partition_size_and_limits_are_read_from_scontrol():
    from axonn_launch.submit.pack import Partition, parse_partitions, partition_of

    assert parse_partitions(SCONTROL) == Partition("debug", 2, None)  # the default one
    assert parse_partitions(SCONTROL, "wide") == Partition("wide", 3, 1590)  # MaxNodes, 1d2h30
    assert parse_partitions(SCONTROL, "nosuch") is None and parse_partitions("", "") is None
    assert partition_of(("#SBATCH --nodes=1", "#SBATCH --partition=wide")) == "wide"
    assert partition_of(("#SBATCH --nodes=1",)) == ""


def test_auto_splits_four_one_node_points_into_packs_no_larger_than_the_partition():
    from axonn_launch.submit.pack import Partition, capped

    four, debug = points(*[(1, 10)] * 4), Partition("debug", 2, None)
    width, limit = auto_width(four, lambda nodes: 10, debug.nodes)
    assert (width, limit) == (2, 10)
    packs = plan(four, width, limit)
    check_fits(packs, 2, 10, 4)
    assert [p.nodes for p in packs] == [2, 2]
    assert auto_width(four, lambda nodes: 10) == (4, 10)  # no partition known: one pack
    # a partition's MaxTime caps a pack's minutes: two 10-min waves need 20, 15 allow one
    limit_of = capped(lambda nodes: 30, Partition("p", 2, 15))
    width, limit = auto_width(four, limit_of, 2)
    assert (width, limit) == (2, 15) and len(plan(four, width, limit)) == 2


@pytest.mark.parametrize(
    ("shapes", "width", "line"),
    [
        ([(3, 10), (1, 10)], 0, "point 0 needs 3 nodes; partition debug has 2 nodes;"
         " valid: a larger partition"),
        ([(1, 10)] * 4, 4, "sweep.pack=4: partition debug has 2 nodes, so a pack of 4 nodes"
         " could never start; valid: 2 or fewer, or auto"),
        ([(1, 10), (1, 90)], 0, "point 1 needs 90 min; partition debug allows 60 min; valid:"
         " machine.slurm.time_min of at most 60"),
    ],
)  # fmt: skip
def test_a_pack_that_could_never_start_is_refused_in_one_line(shapes, width, line):
    from dataclasses import replace

    from axonn_launch.submit.pack import Partition, fitting

    group = [replace(p, width=width) for p in points(*shapes)]
    assert fitting(group, Partition("debug", 2, 60)) == line
    assert fitting(group, None) == ""  # no partition known (a dry run): nothing refused


def test_a_pack_held_for_a_reason_that_never_clears_is_not_shown_as_running():
    from axonn_launch.records.runs import pack_word
    from axonn_launch.records.status import JobStatus
    from axonn_launch.scheduler.slurm_queries import held_for_good, start_words

    assert held_for_good("PartitionNodeLimit") and held_for_good("AssocMaxNodesPerJob")
    assert not held_for_good("Resources") and not held_for_good("Priority")
    held = start_words("N/A", "PartitionNodeLimit")
    assert held.startswith("held by Slurm for good (PartitionNodeLimit, squeue)")
    waiting = start_words("N/A", "Resources")

    def row(state: str, failure: str, start: str) -> JobStatus:
        found = JobStatus("/j/0", "57", "p", "slurm_local", "gpt_tiny", "", 1, state, None, 8,
                          None, None, None, failure, "", "", 1)  # fmt: skip
        found.expected_start = start
        return found

    assert pack_word(row("PENDING", "running", held)) == (
        "held by Slurm for good (PartitionNodeLimit, squeue)"
    )
    assert pack_word(row("PENDING", "running", waiting)) == "pending"
    assert pack_word(row("RUNNING", "running", "")) == "running"
