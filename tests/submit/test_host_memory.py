"""Host memory and cores on machine=local.

A rank that the kernel's OOM killer kills inside a real memory cgroup (made here: the
suite runs as root, here and in CI) is classed ``host_oom`` from the supervisor's record of
the cgroup's ``oom_kill`` count, never ``rank_killed``, and recovery does not resume it.
The login node's refusal of a model too big for this computer is a row of
tests/config/test_bad_input.py; the cores warning is checked here with a real CPU affinity.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from axonn_launch.common import hostmem
from axonn_launch.common.jobdir import JobPaths, read_record
from axonn_launch.submit import chain
from tests.conftest import REPO

LIMIT = 2 * hostmem.GIB  # room for the launcher, the warm start and two gpt_tiny ranks
SMALL = ["machine=local", "model=gpt_tiny", "grid.x=2", "train.steps=4",
         "train.checkpoint_every=2", "train.warmup_steps=0", "train.sample_tokens=0",
         "train.progress=false", "train.gemm_tuning=false", "train.eval_batches=0"]  # fmt: skip


def v2_root_with_memory(mounts: dict[str, Path]) -> Path | None:
    root = mounts.get("unified")
    controls = root / "cgroup.subtree_control" if root else None
    return root if controls and "memory" in controls.read_text().split() else None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A new memory cgroup of ``limit`` bytes and no swap; on leaving, the processes this
    test started in it are killed (by pid) and the group removed."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    mounts = hostmem.cgroup_mounts()
    root = mounts.get("memory") or v2_root_with_memory(mounts)
    if root is None:
        pytest.skip("no cgroup v1 memory hierarchy, nor a v2 root that delegates memory")
    group = root / f"axonn_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup in {root}: {exc}")
    try:
        if (group / "memory.limit_in_bytes").exists():  # v1: memory first, then memory+swap
            (group / "memory.limit_in_bytes").write_text(str(limit))
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
        yield group
    finally:
        remove_group(group)


def remove_group(group: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        for pid in pids:  # what this test started in the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            group.rmdir()
            return
        time.sleep(0.2)
    raise AssertionError(f"could not remove {group}")


def in_group(group: Path):
    """A child's preexec: move itself into ``group`` before it runs anything."""
    return lambda: (group / "cgroup.procs").write_text(str(os.getpid()))


def python(args: list[str], cwd: Path, group: Path | None = None, env=None):
    """``python ARGS`` in ``cwd`` (inside ``group`` when given)."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True,
        timeout=240, preexec_fn=in_group(group) if group else None,
    )  # fmt: skip


PROBE = (  # what hostmem.available() says inside the group
    "from axonn_launch.common import hostmem; r = hostmem.available();"
    " print(f'{r.source}\\t{r.bytes}')"
)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_rank_the_oom_killer_kills_is_host_oom_and_recovery_stops(tmp_path):
    """Rank 1 allocates after step 2 until the cgroup's OOM killer kills it: the supervisor
    reads the cgroup's oom_kill count, records host_oom, and recovery (on) stops the run."""
    root = tmp_path / "run"
    with memory_cgroup(LIMIT) as group:
        room = python(["-c", PROBE], tmp_path, group)
        launched = python(
            ["-m", "axonn_launch", *SMALL, "recovery=on", "recovery.backoff_s=0",
                             f"hydra.run.dir={root}"],
            tmp_path, group, env={"AXONN_FAULT": "oom@step2:rank1"},
        )  # fmt: skip
        wait_for(lambda: chain.run_state(root) == chain.STOPPED, 60, "the run stopped")
    said = launched.stdout + launched.stderr
    assert launched.returncode != 0, said[-3000:]
    # what this computer can give inside the group: its limit less what it holds
    source, available = room.stdout.split("\t")
    assert source == f"memory cgroup {group} (limit 2.0 GiB)", room.stdout + room.stderr
    assert 0 < int(available) < LIMIT

    record = read_record(root)
    assert (record["status"], record["failure"]) == ("failed", "host_oom"), record
    assert record["ended_by"]["rank"] == 1 and record["ended_by"]["signal"] == "SIGKILL"
    evidence = json.loads((JobPaths(root).failures / "rank_1.json").read_text())
    assert evidence["failure_class"] == "host_oom" and evidence["cgroup"] == str(group)
    before, after = evidence["oom_kill"]
    assert after > before and evidence["limit_bytes"] == LIMIT
    if kernel_log_readable():  # root here and in CI: the kernel's own line names the pid
        assert f"Killed process {evidence['pid']} (axonn-rank-1)" in evidence["kernel_log"]
    assert "rank 1 (pid" in said and "was killed by the kernel's OOM killer" in said

    history = chain.chain_of(root)
    assert chain.attempts_of(root) == [root]  # nothing resumed
    assert history["stop"]["class"] == "host_oom", history

    status = python(["-m", "axonn_launch.jobs", "status", str(root)], tmp_path).stdout
    assert "host_oom" in status and "rank_killed" not in status, status
    note = next(line for line in status.splitlines() if "OOM killer" in line)
    assert "use fewer ranks, a smaller model, a smaller train.micro_batch" in note, status
    again = python(["-m", "axonn_launch.jobs", "resubmit", str(root), "--dry-run"], tmp_path)
    assert "host_oom: would fail again" in again.stdout + again.stderr, again.stdout


def kernel_log_readable() -> bool:
    try:
        os.close(os.open(hostmem.KMSG, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


def test_cgroup_v2_files_read_as_v1_files_do(tmp_path):
    """The v2 names (memory.events, memory.max, memory.current, memory.stat's inactive_file)
    give the count and the room that v1's do (this machine runs v1; CI may run v2)."""
    group = tmp_path / "child"
    group.mkdir()
    for folder in (tmp_path, group):
        (folder / "cgroup.procs").write_text("")
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    (group / "memory.max").write_text(f"{3 * hostmem.GIB}\n")
    (group / "memory.current").write_text(f"{2 * hostmem.GIB}\n")
    (group / "memory.stat").write_text(f"anon 1\ninactive_file {hostmem.GIB // 2}\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert hostmem.oom_kills(group) == 2
    (room,) = hostmem.cgroup_rooms(group)  # the parent has no limit
    assert room.bytes == 3 * hostmem.GIB - (2 * hostmem.GIB - hostmem.GIB // 2)
    assert room.source == f"memory cgroup {group} (limit 3.0 GiB)"


def test_more_than_two_ranks_per_core_warn_in_one_line(tmp_path):
    """On one core (a real CPU affinity), 4 ranks warn and name the grid that fits."""
    proc = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-m", "axonn_launch", "grid.x=4", "dry_run=true",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert warnings == [
        "warning: grid (data=1 x=4 y=1 z=1): 4 ranks on 1 core(s) of this computer"
        " (machine=local): more than 2 per core, so every step waits for ranks that are not"
        " running; a grid of at most 2 ranks is faster"
    ], proc.stderr
