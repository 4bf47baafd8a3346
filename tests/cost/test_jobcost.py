"""jobcost: the checkpoint's chunk count matches the saver's boxes; costs follow the shard."""

from __future__ import annotations

import pytest

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.cost.jobcost import checkpoint_chunks, job_cost
from axonn_launch.cost.memory import local_param_elements
from axonn_launch.plan import main as plan_main

SPEC = ModelSpec("t", n_layer=2, d_model=32, n_head=4, vocab_size=64, max_seq_len=16)


def saved_chunks(grid: Grid) -> int:
    """Chunks the DCP save planner writes for SPEC on ``grid`` (parameters and moments)."""
    from axonn_launch.common.spec import OverlapConfig
    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.parallel.shards import grid_position, shard_spec

    count = 0
    for rank in range(grid.world_size):
        groups = grid_position(grid, rank)
        model = GPT(SPEC, groups=groups, overlap=OverlapConfig())
        for param in model.parameters():
            spec = shard_spec(param.shard_layout, groups)
            count += len(spec.pieces) if spec.writes else 0
    return 3 * count


@pytest.mark.parametrize(
    "grid", [Grid(x=2, y=2, z=2), Grid(y=4, z=2), Grid(x=2, z=4), Grid(z=4), Grid(data=2, x=2)]
)
def test_chunk_count_bounds_what_the_saver_writes(grid):
    exact = saved_chunks(grid)
    assert exact <= checkpoint_chunks(SPEC, grid) <= 1.3 * exact


def test_costs_follow_the_shard_not_the_model():
    small, large = Grid(x=2, z=2), Grid(x=2, y=2, z=2)
    a, b = job_cost(SPEC, small, on_gpu=False), job_cost(SPEC, large, on_gpu=False)
    assert a.shard_elements == local_param_elements(SPEC, small)
    assert b.init_s < a.init_s and b.start_bytes < a.start_bytes
    gpu = job_cost(SPEC, large, on_gpu=True)
    assert gpu.start_bytes < b.start_bytes  # the state is in GPU memory
    assert gpu.save_bytes > gpu.start_bytes  # the async save stages a host copy


def test_plan_states_the_job_start_cost(capsys):
    assert plan_main(["machine=frontier", "model=gpt_320b", "nodes=4096", "top=1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (cost,) = [ln for ln in lines if ln.startswith("job start, save and resume on ")]
    assert "host memory at start" in cost and "initialization <=" in cost
    assert lines[-1].startswith("python -m axonn_launch ")  # plan ends with the launch command
