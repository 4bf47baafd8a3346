"""The cost model runs once per thing it costs, in one real launch (``python -m
axonn_launch ... dry_run=true``): memory is estimated at most once per micro-batch candidate
of an explicit grid, and at most once per candidate grid the planner weighs with grid=auto.
The counts are read from inside the launcher process: ``estimate_memory``'s own cache
statistics (a miss is a computed estimate) and a counting wrapper around the planner's
``evaluate_grid``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from axonn_launch.common import rules
from axonn_launch.common.grid import Grid
from axonn_launch.config.compose import compose, to_launch_config
from axonn_launch.cost import memory
from tests.conftest import REPO

COUNTING_LAUNCH = """
import json, sys
from axonn_launch.cost import memory, planner
from axonn_launch.cli import main
grids = set()
evaluate = planner.evaluate_grid
def counted(hardware, model, train, grid, cal):
    grids.add((grid, train.global_batch))
    return evaluate(hardware, model, train, grid, cal)
planner.evaluate_grid = counted
sys.argv = ["axonn_launch", *sys.argv[1:]]
try:
    main()
finally:
    info = memory.estimate_memory.cache_info()
    print(json.dumps({"estimates": info.misses, "asked": info.misses + info.hits,
                      "grids": len(grids)}), file=sys.stderr)
"""


def launch_counts(tmp_path, *overrides: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", COUNTING_LAUNCH, *overrides, "dry_run=true",
         f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stderr.strip().splitlines()[-1])


def test_an_explicit_grid_estimates_memory_at_most_once_per_micro_batch(tmp_path):
    overrides = ("machine=frontier", "model=gpt_320b", "grid.x=8", "grid.z=16", "nodes=16")
    counts = launch_counts(tmp_path, *overrides)
    train = to_launch_config(compose(list(overrides))).train
    candidates = rules.micro_batch_candidates(train, Grid(x=8, z=16))
    assert counts["grids"] == 0  # no planner on an explicit grid
    assert 1 <= counts["estimates"] <= len(candidates), counts


def test_grid_auto_estimates_memory_at_most_once_per_candidate_grid(tmp_path):
    counts = launch_counts(tmp_path, "machine=frontier", "model=gpt_320b")
    assert counts["grids"] > 100  # the planner searched node counts and grids
    assert counts["estimates"] <= counts["grids"], counts


@pytest.mark.parametrize("model", ["gpt_320b", "llama_tiny"])
def test_scaling_the_micro_batch_equals_estimating_it(model):
    """fit_micro_batch scales one estimate's token terms instead of estimating again."""
    cfg = to_launch_config(compose(["machine=frontier", f"model={model}"]))
    grid = Grid(data=2, x=2, y=2, z=4)
    train = replace(cfg.train, global_batch=64, cache_layers=0)
    candidates = rules.micro_batch_candidates(train, grid)
    assert len(candidates) >= 3
    largest = memory.estimate_memory(
        model=cfg.model, grid=grid, train=replace(train, micro_batch=candidates[0])
    )
    for micro in candidates:
        direct = memory.estimate_memory(
            model=cfg.model, grid=grid, train=replace(train, micro_batch=micro)
        )
        scaled = largest.at_micro_batch(micro / candidates[0])
        assert scaled.terms.keys() == direct.terms.keys()
        for term, value in direct.terms.items():
            assert scaled.terms[term] == pytest.approx(value, rel=1e-12), term
