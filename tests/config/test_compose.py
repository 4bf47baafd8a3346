"""Every machine x model preset composes, validates and renders a dry run."""

import dataclasses
import re
from pathlib import Path

import pytest

from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import resolve
from axonn_launch.cost.memory import GIB
from axonn_launch.submit.pipeline import batch_script

CONF = Path(__file__).resolve().parents[2] / "axonn_launch" / "conf"
MACHINES = sorted(p.stem for p in (CONF / "machine").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def test_the_tree_has_every_public_option():
    assert MACHINES == ["alps", "frontier", "local", "lumi", "perlmutter", "slurm_local"]
    assert set(MODELS) >= {"gpt_tiny", "gpt_small", "hf", "llama_tiny", "tinyllama_1b"} | {
        f"gpt_{n}b" for n in (5, 10, 20, 40, 60, 80, 160, 320, 640)
    } | {f"llama3_{n}b" for n in (8, 70, 405)}


# model=hf takes its shape from model.init_from's config.json: tests/common/test_hf.py
@pytest.mark.parametrize("model", [m for m in MODELS if m != "hf"])
@pytest.mark.parametrize("machine", MACHINES)
def test_dry_run_renders_for_every_machine_and_model(machine, model, tmp_path):
    cfg = load([f"machine={machine}", f"model={model}", "dry_run=true"])
    resolved = resolve(cfg)
    grid = resolved.grid
    assert resolved.nodes * resolved.tasks_per_node == grid.world_size
    assert cfg.model.n_head % grid.y == 0 and cfg.model.d_model % (grid.x * grid.y) == 0
    limit = cfg.machine.hardware.mem_per_gpu_gb
    if limit:
        assert resolved.memory.total <= limit * GIB
    script = batch_script(cfg, resolved, tmp_path)
    if cfg.machine.scheduler == "slurm":
        assert f"#SBATCH --nodes={resolved.nodes}\n" in script
        assert f"#SBATCH --ntasks-per-node={resolved.tasks_per_node}\n" in script
        assert re.search(r"^srun .* -m submitit.core._submit ", script, flags=re.M)
    else:
        assert script == ""


@pytest.mark.parametrize("machine", ["frontier", "perlmutter", "alps"])
def test_an_explicit_grid_too_small_for_the_model_fails_on_memory(machine):
    cfg = load(
        [
            f"machine={machine}",
            "model=gpt_640b",
            "grid.data=1",
            "dry_run=true",
            "nodes=1",
            f"grid.x={load([f'machine={machine}']).machine.hardware.gpus_per_node}",
        ]
    )
    with pytest.raises(ConfigError, match=r"GiB per GPU but .* has \d+ GiB \(largest term"):
        resolve(cfg)


def test_automatic_cache_layers_is_resolved_before_the_job_sees_it():
    """train.cache_layers=null asks the planner, on an explicit grid and with grid=auto;
    the job always gets a number, and a grid without z has nothing to cache."""
    from axonn_launch.cost import planner
    from axonn_launch.cost.memory import estimate_memory

    common = ["machine=frontier", "model=gpt_20b", "train.global_batch=64", "dry_run=true"]
    cfg = load([*common, "grid.x=8", "grid.z=8", "train.cache_layers=null"])
    resolved = resolve(cfg)
    cache = resolved.train.cache_layers
    assert isinstance(cache, int) and 0 < cache <= cfg.model.n_layer
    asked = dataclasses.replace(resolved.train, cache_layers=None)
    expected = planner.resolve_cache_layers(cfg.machine.hardware, cfg.model, asked, resolved.grid)
    assert cache == expected
    assert (
        resolved.memory.total
        == estimate_memory(model=cfg.model, grid=resolved.grid, train=resolved.train).total
    )
    assert resolved.memory.fits(cfg.machine.hardware.mem_per_gpu_gb)
    planned = resolve(load([*common, "nodes=8", "grid=auto", "train.cache_layers=null"]))
    assert isinstance(planned.train.cache_layers, int)
    no_z = resolve(load([*common, "grid.x=8", "grid.y=8", "train.cache_layers=null"]))
    assert no_z.train.cache_layers == 0
