"""``rehearse=rank``: one rank of a 64-rank Frontier job (gpt_tiny on 8 nodes x 8 GCDs) runs
on this computer with torch's fake process group, through every phase: groups, its shard,
forward, backward, an optimizer step, and its DCP shard saved and loaded back. Its record
is checked field by field against the grid, the memory model and the files it wrote."""

import json
import math

import pytest

from tests.conftest import run_launcher

ARGS = ["machine=frontier", "model=gpt_tiny", "nodes=8", "train.threads=1"]
PHASES = ["groups", "init", "forward", "backward", "optimizer step", "save", "load"]
MIB = 1024**2
# what a tiny model's peak may exceed the memory model by: the allocator's arenas and the
# first use of the DCP writer, measured at about 20 MiB here
SLACK = 64 * MIB


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    job = tmp_path_factory.mktemp("rank") / "job"
    args = [*ARGS, "rehearse=rank", "rehearse_rank=5", f"hydra.run.dir={job}"]
    done = run_launcher(args, cwd=job.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, job, json.loads((job / "rank_rehearsal.json").read_text())


def expected_groups(grid: dict) -> int:
    """Groups ``build_groups`` creates: one per line of each axis longer than 1, the
    x*y planes, a second set of z groups, and the world."""
    world = math.prod(grid.values())
    count = sum(world // grid[a] for a in ("x", "y", "z", "data") if grid[a] > 1)
    count += world // (grid["x"] * grid["y"]) if grid["x"] * grid["y"] > 1 else 0
    count += world // grid["z"] if grid["z"] > 1 else 0
    return count + 1


def test_the_rank_runs_every_phase_of_its_real_job(rehearsed):
    done, _, record = rehearsed
    assert (record["rank"], record["world_size"]) == (5, 64)
    assert math.prod(record["grid"].values()) == 64
    assert [row["phase"] for row in record["phases"]] == PHASES
    assert all(row["seconds"] > 0 for row in record["phases"])
    assert record["phases"][0]["groups_created"] == expected_groups(record["grid"])
    assert "reloaded equal" in done.stdout and "peak RSS GiB" in done.stdout


def test_its_shard_and_peak_agree_with_the_memory_model(rehearsed):
    _, _, record = rehearsed
    init = record["phases"][1]
    assert init["local_parameters"] * 4 == pytest.approx(record["model_terms"]["parameters"])
    peak = record["peak_above_baseline_bytes"]
    assert record["baseline_rss_bytes"] > 100 * MIB  # torch is in it
    assert 0 < peak <= record["model_bytes"] + SLACK


def test_its_dcp_shard_is_written_and_reads_back_equal(rehearsed):
    _, job, record = rehearsed
    checkpoint = record["checkpoint"]
    files = list((job / "rank_rehearsal" / "checkpoints").glob("step_*/*"))
    assert {".metadata", "__0_0.distcp"} <= {f.name for f in files}
    assert checkpoint["bytes_written"] == sum(f.stat().st_size for f in files)
    assert checkpoint["bytes_written"] >= checkpoint["predicted_bytes"] > 0
    assert checkpoint["tensors_written"] > 0 and checkpoint["reloaded_equal"] is True
    assert record["phases"][-1]["bytes_read"] > 0


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["rehearse=rank", "rehearse_rank=64"], "rehearse_rank=64: the job has 64 ranks"),
        (["rehearse=rank", "rehearse_rank=-1"], "valid: 0..63"),
        (["rehearse_rank=3"], "rehearse_rank=3: only with rehearse=rank"),
    ],
)
def test_a_rank_outside_the_job_is_one_line(tmp_path, extra, said):
    job = tmp_path / "job"
    done = run_launcher([*ARGS, *extra, f"hydra.run.dir={job}"], cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert not job.exists()
