"""Hydra multirun: every point validated and rendered on its own, with its own node count."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_launcher


def test_sweep_points_get_their_own_node_counts_and_a_summary(tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "machine=slurm_local",
        "grid.x=2",
        "grid.z=1,2,3",
        "dry_run=true",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_launcher(args, cwd=tmp_path, path_prefix=bindir)
    assert result.returncode == 1, result.stderr  # one point is invalid
    assert "point 2: invalid: grid.z=3" in result.stderr
    table = result.stdout.split("sweep summary:")[1]
    # nodes, grid (data,x,y,z), predicted s/step: none for CPU ranks
    assert re.search(r"grid.z=1 dry_run=True\s+dry_run\s+-\s+1\s+\(1,2,1,1\)\s+-\s", table)
    assert re.search(r"grid.z=2 dry_run=True\s+dry_run\s+-\s+2\s+\(1,2,1,2\)\s+-\s", table)
    assert re.search(r"grid.z=3 dry_run=True\s+invalid", table)
    assert table.splitlines()[-1] == (
        "next: fix or leave out point 2 (its reason is in the table); then the same command"
        " without dry_run=true submits 2 points"
    )
    assert "--- batch script ---" not in result.stdout  # a point names its script only
    points = sorted(p for p in sweep_dir.iterdir() if (p / "job.json").exists())
    nodes = sorted(json.loads((p / "job.json").read_text())["nodes"] for p in points)
    assert nodes == [1, 2]
    for point in points:
        record = json.loads((point / "job.json").read_text())
        script = (point / "submission.sh").read_text()
        assert f"#SBATCH --nodes={record['nodes']}" in script
    assert not marker.exists()


def test_a_typo_in_any_point_stops_the_sweep_before_anything_runs(tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    result = run_launcher(
        ["-m", "machine=slurm_local,nosuch", "dry_run=true"], cwd=tmp_path, path_prefix=bindir
    )
    assert result.returncode == 2
    (said,) = result.stderr.strip().splitlines()  # one line, with how to add a machine
    assert said.startswith(
        "error: machine='nosuch': no such machine; valid: alps, frontier, local, lumi, perlmutter,"
        " slurm_local; to add one, write DIR/machine/nosuch.yaml"
    ), said
    assert not (tmp_path / "jobs").exists()


def test_sweeping_grid_pick_runs_the_planners_top_candidates_as_separate_jobs(tmp_path):
    from axonn_launch.config.compose import load
    from axonn_launch.cost.planner import plan

    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "machine=frontier",
        "model=gpt_80b",
        "grid=auto",
        "grid.pick=0,1,2",
        "nodes=128",
        "dry_run=true",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_launcher(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/job.json"))]
    cfg = load(["machine=frontier", "model=gpt_80b"])
    top = plan(machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=128, top=3)
    assert [r["grid"] for r in records] == [row.grid.as_dict() for row in top]
    assert all(r["nodes"] == 128 for r in records)
    # the table: each point's grid and the planner's predicted s/step; then what is next
    header, *rows, last = result.stdout.split("sweep summary:\n")[1].splitlines()
    at = header.index("grid (d,x,y,z)")
    for row, best in zip(rows, top, strict=True):
        g = best.grid
        grid, predicted = row[at:].split()[:2]
        assert grid == f"({g.data},{g.x},{g.y},{g.z})" and predicted == f"{best.step_time_s:.3g}"
    assert last == "next: the same command without dry_run=true submits 3 points"
    assert len((result.stdout + result.stderr).splitlines()) <= 80  # it printed 1,021 lines


@pytest.mark.slow
def test_points_are_named_by_their_values_and_the_summary_compares_them(tmp_path):
    """Two real local points: their own names and dirs, and loss, tok/s and step time.
    A 1-rank and a 2-rank job, one after the other, without the sample after training
    (``train.sample_tokens=0``, which their names show: it was a third of the test's CPU)."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "grid.x=1,2", "train.steps=2", "train.sample_tokens=0",
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(json.loads(p.read_text())["name"] for p in sweep_dir.glob("*/job.json"))
    assert names == ["gpt_tiny-local-x1-steps2-sample_tokens0",
                     "gpt_tiny-local-x2-steps2-sample_tokens0"]  # fmt: skip
    assert sorted(p.name for p in sweep_dir.glob("*/job.json") for p in [p.parent]) == [
        "0-gpt_tiny-local-x1-steps2-sample_tokens0",
        "1-gpt_tiny-local-x2-steps2-sample_tokens0",
    ]
    header, *rows = result.stdout.split("sweep summary:\n")[1].splitlines()[:3]
    at = {name: header.index(name) for name in ("loss", "tok/s", "step s", "val_loss")}

    def cell(row: str, name: str) -> str:
        return row[at[name] :].split()[0]

    losses = []
    for row in rows:
        job_dir = Path(row.split()[-1])
        summary = json.loads((job_dir / "summary.json").read_text())
        assert cell(row, "loss") == f"{summary['final_loss']:.4f}"
        assert cell(row, "tok/s") == f"{summary['tokens_per_s']:.0f}"
        assert cell(row, "step s") == f"{summary['step_time_s']:.3g}"
        losses.append(summary["final_loss"])
    assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)  # same model


def test_points_sharing_one_composition_still_each_get_their_own_values(tmp_path):
    """The argument check composes once and applies each point's values to a copy; one
    bad value among many stops the sweep in one line naming it, with nothing written."""
    from axonn_launch.config.compose import compose, to_launch_config
    from axonn_launch.config.sweep_compose import SharedComposition

    shared = SharedComposition()
    points = [["machine=slurm_local", f"train.seed={s}", f"train.steps={n}"]
              for s in range(1, 4) for n in (5, 7)]  # fmt: skip
    for point in points:
        assert to_launch_config(shared.tree(point)) == to_launch_config(compose(point))
    assert len(shared.bases) == 1  # the six points share one composition
    typo = ["machine=slurm_local", "train.stepz=3"]
    with pytest.raises(Exception) as shared_error:
        shared.tree(typo)
    with pytest.raises(Exception) as own_error:
        compose(typo)
    assert str(shared_error.value) == str(own_error.value)

    # a big dry run: the bad value comes after 240 good points, each checked first
    seeds = ",".join(str(s) for s in range(1, 121))
    args = ["-m", "machine=slurm_local", "train.steps=4,8,x", f"train.seed={seeds}",
            "dry_run=true", f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: train.steps='x': expected an integer"]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_each_point_of_a_shared_composition_keeps_its_own_overrides(tmp_path, fake_sbatch, dry_run):
    """Hydra's composition of each point is shared too: each job still gets its own seed,
    its own ``overrides.yaml`` and its own name. A dry run's points skip Hydra's
    ``.hydra/*.yaml`` (nothing reads them; the launcher's config.yaml is there); a real
    sweep's points write them (sbatch is a fake here)."""
    bindir, marker = fake_sbatch
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "machine=slurm_local", "train.seed=3,1,2", f"dry_run={dry_run}",
            "recovery=off", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, path_prefix=bindir)
    assert result.returncode == 0, result.stderr
    for num, seed in enumerate((3, 1, 2)):
        (job_dir,) = sweep_dir.glob(f"{num}-*")
        assert job_dir.name == f"{num}-gpt_tiny-slurm_local-seed{seed}"
        assert f"seed: {seed}\n" in (job_dir / "config.yaml").read_text()
        assert (job_dir / ".hydra").exists() is not dry_run
        if not dry_run:
            overrides = (job_dir / ".hydra" / "overrides.yaml").read_text()
            assert overrides.splitlines()[1:] == [f"- train.seed={seed}", "- dry_run=False",
                                                  "- recovery=off"]  # fmt: skip
            assert f"seed: {seed}\n" in (job_dir / ".hydra" / "config.yaml").read_text()
    assert marker.exists() is not dry_run


@pytest.mark.parametrize("resolve", [False, True])
@pytest.mark.parametrize("machine", ["slurm_local", "local", "perlmutter"])
def test_job_yaml_text_is_omegaconfs_own(machine, resolve):
    """A job's YAML files (config.yaml, .hydra/*.yaml) are made with libyaml's emitter and
    copied by pickle: the same text and the same config as OmegaConf's own."""
    import copy

    from omegaconf import OmegaConf

    from axonn_launch.config.compose import compose, config_yaml_text, copy_config, yaml_text

    tree = compose([f"machine={machine}"])
    assert config_yaml_text(tree) == OmegaConf.to_yaml(tree)
    container = OmegaConf.to_container(tree, resolve=resolve)
    assert yaml_text(container) == OmegaConf.to_yaml(OmegaConf.create(container))
    copied = copy_config(tree)
    assert OmegaConf.to_yaml(copied) == OmegaConf.to_yaml(copy.deepcopy(tree))
    assert OmegaConf.is_struct(copied) == OmegaConf.is_struct(tree)


@pytest.mark.parametrize(
    "value",
    ["true", "1", "1.5e3", "off", "", " lead", "x" * 200, "a b " * 60, "two\nlines",
     "tab\there", "caf\u00e9 " * 30, "${x}", "'q' \"dq\"", None, 0.1, 10**30, [], {}],
)  # fmt: skip
def test_yaml_text_matches_omegaconf_for_awkward_strings(value):
    from omegaconf import OmegaConf

    from axonn_launch.config.compose import yaml_text

    container = {"k": value, "l": [value, {"n": value}], "same": [value, value]}
    assert yaml_text(container) == OmegaConf.to_yaml(OmegaConf.create(container))
