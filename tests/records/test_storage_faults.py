"""Storage faults are their own class: a job dir whose file system fills up (a real local
run on a small tmpfs) ends in one line, a final job.json and the class ``storage_full``
with no node blamed; after space is freed, a relaunch with ``resume=true`` resumes from the
last complete step as a new attempt. A job dir's ext4 that fails and turns read-only while
a real run trains is ``storage_error`` naming its mount point, and the checkpoint saved
before survives the repair and is resumed from. Unit tests: the classification from log
text and from a rank's failure record, and record writes that fail on a full disk leave
nothing half-written behind."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from axonn_launch.common import fserrors, jobdir
from axonn_launch.records import failures, status
from axonn_launch.records.failures import Evidence, classify
from axonn_launch.submit import pipeline
from tests.conftest import REPO, run_launcher

MiB = 1 << 20
FS_SIZE_MIB = 100
# one checkpoint of the model below is 37.7 MiB: 60 MiB free holds one, not two
BALLAST_MIB = 40
OVERRIDES = [
    "machine=local", "model=gpt_tiny", "model.d_model=256", "model.n_layer=4",
    "grid.x=2", "grid.z=1", "train.steps=10", "train.checkpoint_every=5",
    "train.keep_checkpoints=1", "train.progress=false", "train.sample_tokens=0",
]  # fmt: skip
GLOO_PEER_CLOSED = (
    "[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:47015. This is typically caused by a remote worker"
    " crashing. Check the logs of the remote worker before reporting an error."
)


@pytest.fixture
def small_fs(tmp_path):
    """A 100 MiB tmpfs, unmounted afterwards (lazily, should a process still hold it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    size = f"size={FS_SIZE_MIB}m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def write_ballast(path: Path, mib: int | None) -> None:
    """``mib`` MiB of data at ``path``; None: as much as the file system takes."""
    chunk = b"\1" * MiB
    with open(path, "wb", buffering=0) as handle:  # each write reaches the file system
        written = 0
        while mib is None or written < mib * MiB:
            try:
                written += handle.write(chunk)  # a short write when the disk fills
            except OSError as error:
                assert error.errno == errno.ENOSPC and mib is None, error
                break


def df_target(path: Path) -> str:
    """The mount point ``df`` names for ``path`` (the tool, not the code under test)."""
    out = subprocess.run(
        ["df", "--output=target", str(path)], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()[-1].strip()


def jobs_status(job: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "status", str(job), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    return row


def launcher_tracebacks(stderr: str) -> list[str]:
    """Traceback lines on the console that are not a rank's (torch prefixes a rank's
    uncaught traceback with ``[rankN]:``; rank 0 shares the launcher's console)."""
    lines = stderr.splitlines()
    return [ln for ln in lines if "Traceback" in ln and not ln.startswith("[rank")]


# --- a real run fills its file system ------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_is_storage_full_in_one_line_and_resumes_once_space_is_freed(small_fs):
    job = small_fs / "job"
    ballast = small_fs / "ballast"
    write_ballast(ballast, BALLAST_MIB)
    args = [*OVERRIDES, f"hydra.run.dir={job}"]
    full = run_launcher(args, cwd=REPO, timeout=300)
    assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-3000:]

    # the launcher: no traceback of its own, one line naming job.json and the error; the
    # ranks: the one whose asynchronous save failed says so in one line, none a traceback
    assert launcher_tracebacks(full.stderr) == [], full.stderr[-4000:]
    console = full.stdout + full.stderr + (job / "axonn_launch.log").read_text()
    assert "Traceback" not in console, console[-4000:]
    full_words = "|".join(failures.STORAGE_FULL_PATTERNS)
    saved = re.search(rf"rank \d: checkpoint save of step_00000010 failed: .*({full_words})",
                      console)  # fmt: skip
    assert saved, console[-4000:]
    every_line_parses(job / "metrics.jsonl")
    assert "Error executing job" not in full.stderr and "Logging error" not in full.stderr
    said = [ln for ln in full.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 1, said
    assert f"{job / 'job.json'}" in said[0] and "No space left on device" in said[0], said

    # job.json final, nothing half-written left beside it or by the dying ranks
    record = json.loads((job / "job.json").read_text())
    assert record["status"] == "failed" and record["failure"] == failures.STORAGE_FULL, record
    assert list(job.glob("job.json.*")) == []
    assert [p.name for p in (job / "logs" / "failures").glob(".*")] == []
    # the save that filled the disk is gone; latest names the last complete step
    assert (job / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert list((job / "checkpoints").glob(".tmp_step_*")) == []

    row = jobs_status(job)
    assert (row["failure"], row["action"]) == (failures.STORAGE_FULL, failures.STOP), row
    assert row["bad_nodes"] == [] and row["slow_nodes"] == [], row
    assert row["reason"].startswith(f"{df_target(job)} (tmpfs) was full"), row["reason"]
    room = re.search(r"([\d.]+) MiB free now, the next checkpoint needs ([\d.]+) MiB \(as "
                     r"step_00000005\); free space", row["reason"])  # fmt: skip
    assert room, row["reason"]
    step = job / "checkpoints" / "step_00000005"
    need = sum(p.stat().st_size for p in step.iterdir()) / MiB
    stats = os.statvfs(job)
    free = stats.f_bavail * stats.f_frsize / MiB
    assert abs(float(room.group(2)) - need) <= 0.05 and abs(float(room.group(1)) - free) <= 0.2
    assert free < need

    # what resubmit does with a stop class: nothing, and it says why
    resubmit = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "resubmit", str(job)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert f"{failures.STORAGE_FULL}: {failures.STOP}" in resubmit.stdout, resubmit.stdout
    after = json.loads((job / "job.json").read_text())
    assert after["job_ids"] == record["job_ids"] and "resubmitted_as" not in after, after

    # space freed: the same launch, asked to continue the run (resume=true), resumes from
    # step 5 as a new attempt beside it (a job dir is never reused: submit/dirguard.py)
    ballast.unlink()
    resumed = run_launcher([*args, "resume=true"], cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "training steps 6..10:" in resumed.stdout, resumed.stdout[-2000:]
    attempt = small_fs / "job_attempt2"
    rows = [json.loads(line) for line in (attempt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    every_line_parses(job / "metrics.jsonl")
    every_line_parses(attempt / "timeline.jsonl")
    assert json.loads((attempt / "summary.json").read_text())["steps"] == 10
    assert (attempt / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    done = jobs_status(attempt)
    assert (done["state"], done["failure"], done["step"]) == ("COMPLETED", "completed", 10)
    assert json.loads((job / "job.json").read_text())["resubmitted_as"] == str(attempt)


def every_line_parses(path: Path) -> None:
    """Each line of a jsonl record is a whole JSON object (none cut off by the full disk)."""
    text = path.read_text()
    assert text.endswith("\n"), text[-200:]
    for line in text.splitlines():
        assert isinstance(json.loads(line), dict), line


def test_a_line_that_does_not_fit_leaves_the_file_as_it_was(small_fs):
    """``append_line`` on a file system with less room than the line: the write fails and
    the file keeps its whole lines, nothing of the new one."""
    path = small_fs / "metrics.jsonl"
    jobdir.append_line(path, json.dumps({"step": 1}))
    write_ballast(small_fs / "ballast", None)  # fill every byte left
    with pytest.raises(OSError) as raised:
        jobdir.append_line(path, json.dumps({"step": 2, "pad": "x" * 300_000}))
    assert raised.value.errno == errno.ENOSPC
    assert path.read_text() == '{"step": 1}\n'


# --- classification ------------------------------------------------------------------------


def test_the_job_side_knows_the_same_file_system_errors_as_the_classes():
    """The rank that fails on its file system ends without a traceback for exactly the
    errnos that records/failures.py classes as storage (``common/fserrors.py``),
    found through causes and DCP's per-rank failures."""
    assert set(failures.STORAGE_ERRNOS) == fserrors.FULL_ERRNOS | fserrors.ERROR_ERRNOS
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("checkpoint save failed") from full
    except RuntimeError as wrapped:
        assert fserrors.file_system_line(wrapped) == "OSError: [Errno 28] No space left on device"
    dcp_like = RuntimeError("CheckpointException ranks:dict_keys([1])\nTraceback (most ...")
    dcp_like.failures = {1: (OSError(errno.EROFS, "Read-only file system"), None)}
    assert fserrors.file_system_line(dcp_like) == "OSError: [Errno 30] Read-only file system"
    zip_writer = RuntimeError(
        "Traceback\n  File x\n[rank0]: RuntimeError: [enforce fail"
        " at inline_container.cc:672] . unexpected pos 704 vs 598\n"
    )
    assert fserrors.file_system_line(zip_writer).endswith("unexpected pos 704 vs 598")
    assert fserrors.file_system_line(ValueError("a bug")) is None
    assert fserrors.file_system_line(OSError(errno.ENOENT, "gone")) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[rank0]: OSError: [Errno 28] No space left on device", failures.STORAGE_FULL),
        ("OSError: [Errno 122] Disk quota exceeded: '/lus/job/metrics.jsonl'",
         failures.STORAGE_FULL),
        ("[rank0]: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos"
         " 704 vs 598", failures.STORAGE_FULL),
        ("OSError: [Errno 30] Read-only file system: '/scratch/job/checkpoints/latest.part'",
         failures.STORAGE_ERROR),
        ("OSError: [Errno 116] Stale file handle", failures.STORAGE_ERROR),
        ("OSError: [Errno 5] Input/output error: '/scratch/job/checkpoints/.tmp_step_5/__0_0"
         ".distcp'", failures.STORAGE_ERROR),
        # a write to a terminal that went away: EIO without a file is not the job dir's
        ("OSError: [Errno 5] Input/output error", failures.CODE_ERROR),
    ],
)  # fmt: skip
def test_storage_words_in_a_log_win_over_the_peers_lost_connections(text, expected):
    ev = Evidence(state="FAILED", exit_code="1:0", logs={0: text, 1: GLOO_PEER_CLOSED})
    diagnosis = classify(ev)
    assert diagnosis.failure == expected, diagnosis
    assert diagnosis.bad_nodes == ()


def test_a_failure_record_shows_enospc_that_no_log_holds():
    """A full disk may leave no log line: the rank's failure record (or the launcher's
    failed write in job.json) is evidence enough, and no node is excluded."""
    peers_only = Evidence(state="FAILED", exit_code="1:0", logs={1: GLOO_PEER_CLOSED},
                          nodes=("n1", "n2"), tasks_per_node=1)  # fmt: skip
    assert classify(peers_only).failure == failures.COLLECTIVE_FAILURE
    record_text = "RuntimeError: checkpoint save failed\n[Errno 28] No space left on device"
    with_record = Evidence(state="FAILED", exit_code="1:0", logs={1: GLOO_PEER_CLOSED},
                           nodes=("n1", "n2"), records=(record_text,))  # fmt: skip
    diagnosis = classify(with_record)
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.STORAGE_FULL, ())
    assert diagnosis.action == failures.STOP
    # a Slurm state outranks a record: the time limit ended the job
    timed_out = Evidence(state="TIMEOUT", records=(record_text,))
    assert classify(timed_out).failure == failures.TIMEOUT


def failed_checkpoint_save() -> RuntimeError:
    """What ``Checkpointer.wait`` raises after a DCP save failed with ENOSPC on rank 1."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as disk_full:
        dcp_error = CheckpointException("write", {1: _wrap_exception(disk_full)})
    try:
        try:
            raise dcp_error
        except BaseException as error:
            raise RuntimeError(f"checkpoint save failed: {error}") from error
    except RuntimeError as wrapped:
        return wrapped


def dead_local_record(**updates) -> dict:
    """job.json of a failed machine=local job whose launcher is long gone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    record = {"job_ids": [f"local-{dead.stdout.strip()}"], "status": "failed", "exit_code": 1,
              "nodes": 1, "tasks_per_node": 2, "steps": 10,
              "submit_time": "2020-01-01T00:00:00+0000"}  # fmt: skip
    return {**record, **updates}


def local_failed_job(job: Path) -> dict:
    """A failed job dir whose only log line is a peer's lost connection."""
    (job / "logs").mkdir(parents=True)
    (job / "logs" / "rank_1.log").write_text(GLOO_PEER_CLOSED + "\n")
    record = dead_local_record()
    jobdir.write_record_file(job, record)
    return record


def test_status_reads_the_errno_of_a_failed_checkpoint_save_from_the_rank_record(tmp_path):
    job = tmp_path / "job"
    record = local_failed_job(job)
    state, diagnosis = status.diagnose(job, record, None, None)
    assert diagnosis.failure == failures.COLLECTIVE_FAILURE  # the peers' words alone

    jobdir.record_failure(job, 1, failed_checkpoint_save())
    (saved,) = jobdir.read_failures(job)
    assert saved["exception"].startswith("RuntimeError: checkpoint save failed")
    assert saved["os_error"] == "[Errno 28] No space left on device"
    state, diagnosis = status.diagnose(job, record, None, None)
    assert (state, diagnosis.failure, diagnosis.bad_nodes) == ("ENDED", "storage_full", ())
    assert diagnosis.reason.startswith(f"{df_target(job)} (")
    assert "no complete checkpoint yet" in diagnosis.reason, diagnosis.reason

    # a record older than this launch (a reused job dir) is not this attempt's
    record["submit_time"] = "2999-01-01T00:00:00+0000"
    assert status.diagnose(job, record, None, None)[1].failure == failures.COLLECTIVE_FAILURE


# --- a real run's job dir turns read-only --------------------------------------------------

RO_STEPS, RO_SAVE_EVERY = 200, 50
RO_OVERRIDES = [
    "machine=local", "model=gpt_tiny", "grid.x=2", "grid.z=1", f"train.steps={RO_STEPS}",
    f"train.checkpoint_every={RO_SAVE_EVERY}", "train.keep_checkpoints=0",
    "train.progress=false", "train.sample_tokens=0",
]  # fmt: skip


@pytest.fixture
def ext4_fs(tmp_path):
    """(mount point, the image's device name): a 128 MiB ext4 on a loop device, mounted
    ``errors=remount-ro`` as job dirs' file systems are, so that an error turns it
    read-only by itself, open files and all. (``mount -o remount,ro`` of a tmpfs is not
    the fault: the kernel refuses it, EBUSY, while a running job holds its logs open for
    writing.) Unmounted afterwards (lazily, should a process still hold it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    image, mount = tmp_path / "ext4.img", tmp_path / "fs"
    mount.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(128 * MiB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    options = "loop,errors=remount-ro"
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", options, str(image), str(mount)], capture_output=True
    ).returncode == 0  # fmt: skip
    if not mounted:
        pytest.skip(f"cannot make and mount an ext4 on a loop device: {made.stderr!r}")
    device = Path(df_source(mount)).name
    try:
        if not Path(f"/sys/fs/ext4/{device}/trigger_fs_error").exists():
            pytest.skip("this kernel's ext4 has no trigger_fs_error")
        yield mount, device
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def df_source(path: Path) -> str:
    out = subprocess.run(
        ["df", "--output=source", str(path)], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()[-1].strip()


def ext4_error(device: str) -> None:
    """An ext4 error, as a failing disk or a corrupt block raises one: the kernel aborts
    the journal and turns the file system read-only (``errors=remount-ro``)."""
    Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("test: the job dir's disk failed")


def back_in_service(image_fs: tuple[Path, str]) -> None:
    """What an administrator does: unmount, repair (e2fsck replays the journal), mount."""
    mount, _ = image_fs
    image = mount.parent / "ext4.img"
    subprocess.run(["umount", str(mount)], check=True)
    fsck = subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, text=True)
    assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors corrected
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(mount)], check=True)


def first_checkpoint(job: Path, run: Future) -> Path:
    """The step ``latest`` names, once the running job has saved one."""
    latest = job / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not run.done():
        name = latest.read_text().strip() if latest.exists() else ""
        if name:
            return job / "checkpoints" / name
        time.sleep(0.02)
    proc = run.result() if run.done() else None
    pytest.fail(f"no checkpoint while the job ran: {proc and proc.stderr[-3000:]}")


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.mark.slow
def test_a_job_dir_turned_read_only_mid_run_is_storage_error_and_keeps_its_checkpoint(ext4_fs):
    """A real run on its own ext4; after its first checkpoint the file system fails and
    turns read-only while the ranks train. The launcher says so in one line; ``jobs
    status`` gives the storage class and the file system by its mount point (no log line,
    failure record or final job.json could be written: the job dir's refusal is the
    evidence); the checkpoint saved before survives the repair byte for byte and a
    ``resume=true`` continues from it. Two real runs and one ``jobs status``: 38-73 s
    measured at load 8-15 on 2 cores; the resume is the proof that nothing was lost."""
    mount, device = ext4_fs
    job = mount / "job"
    args = [*RO_OVERRIDES, f"hydra.run.dir={job}"]
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_launcher, args, cwd=REPO, timeout=300)
        saved = first_checkpoint(job, run)
        kept = digests(saved)
        ext4_error(device)
        proc = run.result()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    with pytest.raises(OSError) as refused:
        (job / "new").touch()
    assert refused.value.errno == errno.EROFS  # the fault is the world's, not the test's
    assert not (job / "summary.json").exists()  # it ended mid-run, not after training

    assert launcher_tracebacks(proc.stderr) == [], proc.stderr[-4000:]
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 1, said
    assert f"{job / 'job.json'}" in said[0] and "Read-only file system" in said[0], said
    assert failures.STORAGE_ERROR in said[0], said

    row = jobs_status(job)
    assert (row["failure"], row["action"]) == (failures.STORAGE_ERROR, failures.STOP), row
    assert row["bad_nodes"] == [] and row["state"] == "ENDED", row
    reason = row["reason"]
    assert reason.startswith(f"I/O error on {df_target(job)} (ext4)"), reason
    assert "[Errno 30] Read-only file system" in reason and "\n" not in reason, reason

    # nothing saved before the change is lost, through the repair
    assert digests(saved) == kept
    back_in_service(ext4_fs)
    assert digests(saved) == kept
    assert (job / "checkpoints" / "latest").read_text().strip() == saved.name
    resumed = run_launcher([*args, "resume=true"], cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    step = int(saved.name.removeprefix("step_"))
    assert f"training steps {step + 1}..{RO_STEPS}:" in resumed.stdout, resumed.stdout[-2000:]
    attempt = mount / "job_attempt2"
    assert json.loads((attempt / "summary.json").read_text())["steps"] == RO_STEPS


# --- record writes on a full disk ----------------------------------------------------------


def test_record_writes_on_a_full_disk_leave_nothing_half_written(small_fs, capsys, monkeypatch):
    monkeypatch.setattr(logging, "raiseExceptions", True)  # the launcher turns it off
    job = small_fs / "job"
    job.mkdir()
    jobdir.write_record_file(job, {"status": "running", "job_ids": ["local-1"]})
    write_ballast(small_fs / "ballast", None)  # every page taken

    big = {"status": "failed", "pad": "x" * 8192}  # needs new pages
    with pytest.raises(OSError) as raised:
        jobdir.write_record_file(job, big)
    assert raised.value.errno == errno.ENOSPC
    assert [p.name for p in job.iterdir()] == ["job.json"]
    assert jobdir.read_record(job)["status"] == "running"

    jobdir.record_failure(job, 0, failed_checkpoint_save())  # never raises
    assert [p for p in job.rglob("*") if p.is_file()] == [job / "job.json"]

    # the launcher: one line, no exception; nothing to free here, so job.json stays
    record = {"status": "running", "job_ids": ["local-1"], "pad": "x" * 8192}
    pipeline.write_record(job, record, status="failed", exit_code=1)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"error: cannot write {job / 'job.json'} ([Errno 28] No space left on device): it"
        f" still says running, not failed (storage_full: see python -m axonn_launch.jobs"
        f" status {job})"
    ]
    assert sorted(p.name for p in job.iterdir() if p.name.startswith("job.json")) == ["job.json"]
    assert jobdir.read_record(job)["status"] == "running"


def test_the_launcher_makes_room_for_a_final_record_and_status_reads_it(small_fs, capsys,
                                                                         monkeypatch):  # fmt: skip
    """The launcher's final write fails on a full disk: it removes the interrupted save
    (what filled it), writes job.json failed/storage_full, and ``jobs status`` classes the
    job from that record alone (no log, no failure record), blaming no node."""
    monkeypatch.setattr(logging, "raiseExceptions", True)
    job = small_fs / "job"
    local_failed_job(job)
    record = dead_local_record(status="running")
    jobdir.write_record_file(job, record)
    interrupted = job / "checkpoints" / ".tmp_step_00000010"
    interrupted.mkdir(parents=True)
    write_ballast(interrupted / "__0_0.distcp", None)

    pipeline.write_record(job, record, status="failed", exit_code=1)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: writing {job / 'job.json'} failed once ([Errno 28] No space left on device);"
        f" written after removing 1 interrupted checkpoint save(s): failed (storage_full: see"
        f" python -m axonn_launch.jobs status {job})"
    )
    written = jobdir.read_record(job)
    assert (written["status"], written["failure"]) == ("failed", failures.STORAGE_FULL)
    assert not interrupted.exists() and list(job.glob("job.json.*")) == []

    state, diagnosis = status.diagnose(job, written, None, None)
    assert (diagnosis.failure, diagnosis.action, diagnosis.bad_nodes) == (
        failures.STORAGE_FULL, failures.STOP, ()
    )  # fmt: skip
    assert diagnosis.reason.startswith(f"{df_target(job)} (tmpfs) was full ([Errno 28] No space")
