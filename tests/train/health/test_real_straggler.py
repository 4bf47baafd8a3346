"""A real straggler: the operating system slows one rank, and the detector names it.

One rank's process is moved into a CPU cgroup at 5 % of a core (``tests/throttle.py``)
after step ``THROTTLE_AT`` of a local run, as a throttled node or a busy core would slow
it; nothing in the job knows. Its peers then wait for it inside every collective of the
step. The detector compares each rank's own work (the step less its time blocked in
collectives, ``train/health/monitor.py``), so the slow rank, and only it, is named by rank
and node: in rank 0's log line, ``metrics.jsonl``, ``summary.json`` and ``jobs status``,
within 3 report intervals. The reports before the throttle, same run, name nobody.
Rank 0 logs to the console log of a local run.

Two grids: x2 z2 (data=1: every rank shares a group with the slow one, so a step's span
alone names nobody) and data=2 x2 (the slow rank's tensor-parallel partner waits in
the x collectives, the other replica in the data all-reduce). Both runs train at once
(one world each, 8 ranks on the machine), which also makes the unthrottled ranks noisy:
the detector must still name nobody else.

Cost: about 60-80 s on 2 cores (two 50-step runs at once, the slow rank's 25 steps at 5 %
of a core); one fixture serves both grids' tests.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths
from tests.conftest import run_launcher
from tests.submit.test_local_supervisor import poll, record
from tests.throttle import cpu_quota

REPO = Path(__file__).resolve().parents[3]
EVERY = 5  # steps between reports
THROTTLE_AT = 25  # five reports before the throttle
STEPS = 50
SLOW_RANK = 3
PERCENT = 5  # of one core: under a 4x oversubscribed machine still a quarter of its share
GRIDS = {"x2z2": ["grid.x=2", "grid.z=2"], "data2x2": ["grid.data=2", "grid.x=2"]}
RUN = ["machine=local", "model=gpt_tiny", "train.warmup_steps=0", "train.sample_tokens=0",
       "train.progress=false", "train.log_every=1", f"train.steps={STEPS}",
       f"train.stragglers.every={EVERY}", "train.checkpoint_every=0", "wait=false"]  # fmt: skip


def rank_pid(job_dir: Path, rank: int) -> int | None:
    """The live process of ``rank`` of the local job in ``job_dir``: a forked rank is
    named ``axonn-rank-<rank>``, an executed one has ``RANK`` in its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            comm = (entry / "comm").read_text().strip()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(job_dir) not in argv:
            continue
        if comm == f"axonn-rank-{rank}" or f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def last_step(job_dir: Path) -> int:
    try:
        lines = JobPaths(job_dir).metrics.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.startswith("{")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Both grids' runs, launched together; rank 3 of each throttled once its run has
    logged step 25: each run's dir and the last step logged before its throttle."""
    root = tmp_path_factory.mktemp("straggler")
    dirs = {name: root / name for name in GRIDS}
    throttled_at: dict[str, int] = {}
    with cpu_quota(PERCENT) as throttle:
        for name, grid in GRIDS.items():
            launched = run_launcher([*RUN, *grid, f"hydra.run.dir={dirs[name]}"], cwd=REPO,
                                    timeout=300)  # fmt: skip
            assert launched.returncode == 0, launched.stdout + launched.stderr
        pids: dict[str, int | None] = {}
        poll(lambda: throttle_due(dirs, throttled_at, throttle, pids), 240, f"step {THROTTLE_AT}")
        for name, job_dir in dirs.items():
            assert throttled_at[name] <= STEPS - 4 * EVERY, throttled_at  # room to be named
            poll(lambda d=job_dir: record(d).get("status") not in (None, "running"), 400,
                 f"{name}: the run's end")  # fmt: skip
            assert record(job_dir)["status"] == "completed", record(job_dir)
    return {name: (dirs[name], throttled_at[name]) for name in GRIDS}


def throttle_due(dirs: dict[str, Path], done: dict[str, int], throttle, pids: dict) -> bool:
    """Throttle rank 3 of each run that has logged step ``THROTTLE_AT``; whether all are.
    Each rank's process is looked up in /proc once, as soon as its run has logged a step:
    a scan of /proc under the suite's load took seconds, and at every poll it let a run go
    8 steps past ``THROTTLE_AT`` before the throttle."""
    for name, job_dir in dirs.items():
        if name in done:
            continue
        step = last_step(job_dir)
        if step and not pids.get(name):
            pids[name] = rank_pid(job_dir, SLOW_RANK)
        if step >= THROTTLE_AT and pids.get(name):
            throttle(pids[name])
            done[name] = step
    return len(done) == len(dirs)


def reports(job_dir: Path) -> list[tuple[int, list[dict]]]:
    """(step, stragglers) of every metrics row that named someone."""
    rows = [json.loads(line) for line in JobPaths(job_dir).metrics.read_text().splitlines()]
    return [(row["step"], row["stragglers"]) for row in rows if row.get("stragglers")]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_the_throttled_rank_and_only_it_is_named_within_three_reports(runs, grid):
    job_dir, slowed_after = runs[grid]
    found = reports(job_dir)
    before = [(step, named) for step, named in found if step <= slowed_after]
    assert before == [], f"named before any rank was slowed: {before}"
    # every report names rank 3 only, and one does by the third report after the throttle
    assert all([s["rank"] for s in named] == [SLOW_RANK] for _, named in found), found
    assert found and found[0][0] <= slowed_after + 3 * EVERY, (slowed_after, found)
    node = found[0][1][0]["node"]
    assert node, found
    last = json.loads(JobPaths(job_dir).stragglers.read_text())
    (named,) = last["stragglers"]
    assert named["rank"] == SLOW_RANK and named["ratio"] >= 1.5, last

    summary = json.loads(JobPaths(job_dir).summary.read_text())
    assert [s["rank"] for s in summary["stragglers"]["stragglers"]] == [SLOW_RANK], summary
    said = JobPaths(job_dir).console_log.read_text()
    lines = [line for line in said.splitlines() if "stragglers at step" in line]
    assert lines and all(f"rank {SLOW_RANK} ({node})" in line for line in lines), lines
    assert not re.search(rf"rank (?!{SLOW_RANK} )\d+ \(", "\n".join(lines)), lines

    shown = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "status", str(job_dir)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"rank {SLOW_RANK} ({node})" in shown.stdout, shown.stdout
