"""``python -m axonn_launch.batch.supervise <job_dir> <world_size>``: the
owner of a local job's rank processes, started by the launcher (``scheduler/processes.py``)
whether it waits for the job or not.

It starts the ranks (forked from the warm start, ``train/zygote.py``), stops them all
when one fails or on a signal, writes job.json's final state and, with ``recovery=on``,
runs the recovery step of a failed attempt. Login-node code: never imports torch.

The early start, the signals and the final record: ``docs/launch.md``
("batch/supervise.py").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from axonn_launch.common import hostmem
from axonn_launch.common.jobdir import (
    RECORD_TIME,
    JobPaths,
    last_job_id,
    read_record_or_empty,
    record_failure,
    record_lock,
    run_root,
    write_record_file,
)
from axonn_launch.common.proctitle import rename_argument
from axonn_launch.scheduler import processes
from axonn_launch.submit import dirlock


class StopRequest:
    """The first stop signal this process got (its name), set by a signal handler, and how
    many came: a first SIGINT (Ctrl-C) alone asks the ranks to save, then stop
    (``saving``); another signal, or a second SIGINT, stops them at once."""

    def __init__(self) -> None:
        self.signal = ""
        self.count = 0

    def install(self) -> None:
        for sig in processes.STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, _frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        self.count += 1

    def __call__(self) -> str:
        return self.signal

    def saving(self) -> bool:
        return self.signal == "SIGINT" and self.count == 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {processes.SUPERVISOR}")
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("world_size", help=f"the number of ranks, or {processes.EARLY}")
    args = parser.parse_args(argv)
    stop = StopRequest()
    stop.install()
    job_id = f"local-{os.getpid()}"
    if args.world_size == processes.EARLY:
        return supervise_early(job_id, stop)
    # the warm start imports the job side while the launcher writes job.json
    warm = processes.WarmStart(args.job_dir) if processes.warm_start_wanted() else None
    return supervise_when_released(args.job_dir, int(args.world_size), job_id, stop, warm)


def supervise_early(job_id: str, stop: StopRequest) -> int:
    """Started before the launcher composed the job (``processes.start_early_supervisor``): the
    warm start imports meanwhile. Then the job, a JSON line (job dir, number of ranks,
    environment), or the end of the input: the launcher needs no local job, and this ends
    without a word or a record."""
    warm = processes.WarmStart(Path(processes.BLANK))
    line = sys.stdin.buffer.readline()
    if not line.strip():
        warm.close(kill=True)
        return 0
    job = json.loads(line)
    job_dir = Path(job["job_dir"])
    rename_argument(processes.BLANK, str(job_dir))  # ps names the job dir, as ever
    warm = take_environment(job["env"], warm, job_dir)
    return supervise_when_released(job_dir, int(job["world_size"]), job_id, stop, warm)


def take_environment(
    env: dict[str, str], warm: processes.WarmStart, job_dir: Path
) -> processes.WarmStart:
    """Make ``env`` this process's environment (the ranks' base, as for a supervisor started
    with it); the warm start is kept when it imported with the same one, but for the
    variables each rank sets again (``processes.THREAD_VARS``), else started afresh with it."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    changed = {k for k in before.keys() | env.keys() if before.get(k) != env.get(k)}
    if changed - set(processes.THREAD_VARS):
        warm.close(kill=True)
        return processes.WarmStart(job_dir)
    return warm


def supervise_when_released(
    job_dir: Path, world_size: int, job_id: str, stop: StopRequest, warm: processes.WarmStart | None
) -> int:
    """Once the launcher says job.json names this process (``processes.GO``), take the job dir's
    lock from it (held while this process lives: a second launch into the dir is refused)
    and supervise the job; else (it ended, or a stop came first) record that no rank
    started."""
    if sys.stdin.buffer.readline() != processes.GO or stop():
        if warm is not None:
            warm.close(kill=True)
        return abandon(job_dir, job_id, stop())
    held = dirlock.hold(job_dir, job_id)
    if held is None:
        say(f"cannot take {JobPaths(job_dir).job_lock}: the job runs, job.json names it")
    return supervise(job_dir, world_size, job_id, stop, warm)


def supervise(
    job_dir: Path,
    world_size: int,
    job_id: str,
    stop: StopRequest,
    warm: processes.WarmStart | None = None,
) -> int:
    """Start the ranks (forked from ``warm`` when given), wait for them (stopping the rest
    when one fails), record the end."""
    oom = hostmem.OomWatch.start()  # the OOM killer's count before the ranks start
    procs = processes.start_ranks(
        job_dir=job_dir, world_size=world_size, warm=warm, stop_requested=stop
    )
    pids = [p.pid for p in procs]
    update_ours(job_dir, job_id, rank_pids=pids)
    ending = processes.with_saved_step(processes.wait_ranks(procs, stop, stop.saving), job_dir)
    if ending.exit_code:
        say(ending.describe(pids))
    record_oom_kill(job_dir, ending, pids, oom)
    record_end(job_dir, job_id, ending, pids)
    if warm is not None:  # after the record, which its exit (unmapping its memory) overlaps
        warm.close()
    recover_run(job_dir, job_id, stop)
    log_goodput_at_end(job_dir)
    return ending.exit_code


def abandon(job_dir: Path, job_id: str, stopped_by: str) -> int:
    """The launcher ended, or asked to stop, before the ranks started: none is started."""
    why = f"{stopped_by} before the ranks started" if stopped_by else "the launcher ended first"
    code = 128 + int(signal.Signals[stopped_by]) if stopped_by else 1
    update_ours(job_dir, job_id, status="failed", exit_code=code, ended_by=why, **end_fields())
    return code


def record_oom_kill(
    job_dir: Path, ending: processes.Ending, pids: list[int], oom: hostmem.OomWatch
) -> None:
    """A rank that died of SIGKILL, which the kernel's OOM killer sent (its cgroup's count
    rose, or the kernel log names it): its failure record says so, with the evidence
    (class ``host_oom``: records/failures.py), before the job's end is classified. The
    rank could write none itself."""
    from axonn_launch.records.failures import HOST_OOM

    rank = ending.cause
    if rank is None or ending.failed[rank] != -signal.SIGKILL:
        return
    evidence = oom.evidence(pids[rank])
    if not evidence:
        return
    line = hostmem.describe_evidence(rank, pids[rank], evidence)
    say(line)
    found = {"failure_class": HOST_OOM, "pid": pids[rank], **evidence}
    record_failure(job_dir, rank, hostmem.HostOutOfMemory(line), found)


def record_end(job_dir: Path, job_id: str, ending: processes.Ending, pids: list[int]) -> None:
    """Final state first (so job.json is final even if classifying fails), then the class
    that ``jobs status`` gives the job."""
    ended_by: dict = {}
    if ending.cause is not None:
        code = ending.failed[ending.cause]
        ended_by = {"rank": ending.cause, "pid": pids[ending.cause], "returncode": code}
        if code < 0:
            ended_by["signal"] = processes.signal_name(-code)
    elif ending.stopped_by:
        ended_by = {"signal": ending.stopped_by}
        if ending.saved_step is not None:  # by the user, saved: jobs resubmit resumes it
            ended_by |= {"by_user": True, "saved_step": ending.saved_step}
    if ended_by:
        ended_by["line"] = ending.describe(pids)
    record = update_ours(
        job_dir,
        job_id,
        status="completed" if ending.exit_code == 0 else "failed",
        exit_code=ending.exit_code,
        rank_exit_codes=list(ending.codes),
        **end_fields(),
        **({"ended_by": ended_by} if ended_by else {}),
    )
    if record is not None:
        record_class(job_dir, job_id, record)


def record_class(job_dir: Path, job_id: str, record: dict) -> None:
    """``failure`` and ``failure_reason`` as ``jobs status`` classifies the ended job; a job
    whose training finished is ``completed`` whatever failed after it (as status settles)."""
    from axonn_launch.records import failures
    from axonn_launch.records.jobdirs import preflight_of
    from axonn_launch.records.status import job_status

    try:
        row = job_status(job_dir, record, None, preflight_of(job_dir, record))
    except Exception as exc:  # the record is final already; the class can wait for status
        say(f"cannot classify the job's end: {type(exc).__name__}: {exc}")
        return
    status = "completed" if row.failure == failures.COMPLETED else record["status"]
    update_ours(job_dir, job_id, status=status, failure=row.failure, failure_reason=row.reason)


def recover_run(job_dir: Path, job_id: str, stop: StopRequest) -> None:
    """The recovery step of a failed attempt with recovery on, or the run's stop when a
    signal stopped the job (or came during the step: it waits for the step to end, so that
    no attempt is left half started). Its one line is said; nothing is raised."""
    record = read_record_or_empty(job_dir)
    failed = record.get("status") == "failed" and last_job_id(record) == job_id
    if not failed or "recovery" not in record:
        settle_done(job_dir, record)
        return
    from axonn_launch.batch.recovery import recover  # composes configs: only when needed

    line = why = ""
    try:
        line = "" if stop() else recover(job_dir)
    except Exception as exc:  # the run must not stay "recovering" with nobody at work
        why = f"the recovery step failed: {type(exc).__name__}: {exc}"
    why = f"{stop()}: the job was stopped" if stop() else why
    try:
        line = stop_run(job_dir, record, why) if why else line
    except OSError as exc:
        line = f"{why}; cannot record that the run stopped: {exc}"
    say(line)


def settle_done(job_dir: Path, record: dict) -> None:
    """A completed attempt of a run with recovery ends the run: chain.state says done."""
    if "recovery" not in record or record.get("status") != "completed":
        return
    from axonn_launch.submit import chain

    try:
        chain.settle_done(run_root(job_dir, record))
    except (OSError, ValueError) as exc:  # jobs status settles it later
        say(f"cannot record that the run is done: {exc}")


def log_goodput_at_end(job_dir: Path) -> None:
    """The run's goodput into its TensorBoard folder when this attempt ended it (no new
    attempt follows: that one's supervisor writes it); ``records/curves.py``. Said in one
    line when it cannot; nothing is raised."""
    record = read_record_or_empty(job_dir)
    if record.get("resubmitted_as") or not record.get("ended"):
        return
    from axonn_launch.records import curves
    from axonn_launch.submit import chain

    try:
        said = curves.log_run_at_end(chain.attempts_of(run_root(job_dir, record)))
    except Exception as exc:  # the job has ended already; jobs status can still write it
        said = [f"goodput not written: {type(exc).__name__}: {exc}"]
    for line in said:
        say(line)


def stop_run(job_dir: Path, record: dict, why: str) -> str:
    """Mark the run stopped; an attempt the recovery step started gets SIGTERM (its
    supervisor stops its ranks). The line to say."""
    from axonn_launch.submit import chain

    root = run_root(job_dir, record)
    stop = {"reason": why, "class": str(record.get("failure", ""))}
    chain.set_chain(root, chain.settings_of(record), state=chain.STOPPED, stop=stop)
    newest = chain.attempts_of(root)[-1]
    started = [] if newest.resolve() == job_dir.resolve() else chain.stop_local_attempt(newest)
    return f"{root}: stop: {why}" + (f"; stopped {newest}" if started else "")


def update_ours(job_dir: Path, job_id: str, **updates) -> dict | None:
    """Update job.json while it names this job (a reused job dir names another); None when
    it does not, or when it cannot be written (said in one line)."""
    try:
        with record_lock(job_dir):
            record = read_record_or_empty(job_dir)
            if last_job_id(record) != job_id:
                return None
            record.update(updates)
            write_record_file(job_dir, record)
            return record
    except OSError as exc:
        say(f"cannot write {job_dir}/job.json: {exc}")
        return None


def say(line: str) -> None:
    print(f"supervisor: {line}", file=sys.stderr, flush=True)


def end_fields() -> dict:
    """job.json's end of a local job, from one reading of the clock: ``ended`` for people
    (whole seconds) and ``ended_at`` for its goodput (records/status.py's ``local_end``)."""
    at = time.time()
    return {"ended": time.strftime(RECORD_TIME, time.localtime(at)), "ended_at": at}


if __name__ == "__main__":
    sys.exit(main())
