"""Pure-Python grid: rank layout against AxoNN's arithmetic, groups, validation."""

import itertools
import json

import pytest
import yaml

from axonn_launch.common.grid import Grid
from tests.conftest import run_launcher

GRIDS = [
    Grid(),
    Grid(x=2, z=2),
    Grid(data=2, x=2, y=2, z=2),
    Grid(data=3, x=4, y=1, z=2),
    Grid(data=1, x=1, y=8, z=1),
    Grid(data=2, x=2, y=3, z=5),
]


def axonn_coords(grid: Grid, rank: int) -> tuple[int, int, int, int]:
    """AxoNN's communication.py with G_inter=1: c fastest, then r, then d, then data."""
    g_c, g_r, g_d = grid.x, grid.y, grid.z
    intra = g_r * g_c * g_d
    intra_rank = rank % intra
    c = intra_rank % g_c
    r = (intra_rank // g_c) % g_r
    d = intra_rank // (g_c * g_r)
    data = rank // intra
    return c, r, d, data


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_coords_match_axonn_layout(grid):
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        assert (c.x, c.y, c.z, c.data) == axonn_coords(grid, rank)
        assert grid.rank(c) == rank


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("axis", ["x", "y", "z", "data"])
def test_groups_partition_world_along_one_axis(grid, axis):
    groups = grid.groups(axis)
    assert sorted(itertools.chain(*groups)) == list(range(grid.world_size))
    assert all(len(g) == grid.size(axis) for g in groups)
    others = [a for a in ("x", "y", "z", "data") if a != axis]
    for group in groups:
        coords = [grid.coords(r) for r in group]
        assert sorted(getattr(c, axis) for c in coords) == list(range(grid.size(axis)))
        for other in others:
            assert len({getattr(c, other) for c in coords}) == 1
        steps = {b - a for a, b in zip(group, group[1:])}
        assert steps <= {grid.stride(axis)}


def test_x_group_is_contiguous_so_it_stays_in_a_node():
    grid = Grid(data=2, x=4, y=2, z=1)
    assert grid.groups("x")[0] == [0, 1, 2, 3]
    assert grid.groups("y")[0] == [0, 4]
    assert grid.groups("data")[0] == [0, 8]


def test_plane_groups_hold_x_times_y_ranks_with_equal_z_and_data():
    grid = Grid(data=2, x=2, y=2, z=2)
    planes = grid.plane_groups()
    assert len(planes) == 4 and all(len(p) == 4 for p in planes)
    assert planes[0] == [0, 1, 2, 3] and planes[1] == [4, 5, 6, 7]


@pytest.mark.parametrize("bad", [{"x": 0}, {"y": -1}, {"z": 1.5}, {"data": True}, {"x": "2"}])
def test_invalid_axis_is_rejected_with_its_name(bad):
    axis = next(iter(bad))
    with pytest.raises(ValueError, match=f"grid.{axis}="):
        Grid(**bad)


def test_world_size_and_rank_bounds():
    grid = Grid(data=2, x=3, y=1, z=2)
    assert grid.world_size == 12 and grid.tensor_parallel == 6
    with pytest.raises(ValueError):
        grid.coords(12)


# ---------------------------------------------------------------------------------------
# The default job takes any grid: train.micro_batch is automatic (rules.py)


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid_args,micro_batch", [(["grid.data=4"], 4), (["grid.data=2", "grid.y=2"], 8)], ids=str
)
def test_the_default_job_runs_on_a_data_parallel_grid(grid_args, micro_batch, tmp_path):
    """gpt_tiny's global_batch=16 over data=4 (or data=2): the launcher picks micro_batch
    16/data, records it, and the job trains with it; only the step count is shortened."""
    job = tmp_path / "job"
    args = [*grid_args, "train.steps=3", "train.sample_tokens=0", f"hydra.run.dir={job}"]
    result = run_launcher(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert f"micro_batch={micro_batch} (automatic)" in result.stdout
    spec = json.loads((job / "spec.json").read_text())
    assert spec["train"]["micro_batch"] == micro_batch
    assert yaml.safe_load((job / "config.yaml").read_text())["train"]["micro_batch"] == micro_batch
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
