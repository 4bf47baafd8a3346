"""machine=local: one process per rank on this computer, torchrun-style, owned by a
supervisor (``axonn_launch.batch.supervise``) whether the launcher waits or not.

The launcher starts the supervisor in a session of its own, names it in job.json
(``local-<supervisor pid>``), then lets it start the ranks; no rank outlives it.

Signals, stopping and recovery of a local run: ``docs/launch.md`` ("scheduler/processes.py").
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths, last_job_id, read_record_or_empty, read_summary

SUPERVISOR = "axonn_launch.batch.supervise"
RANK_MODULE = "axonn_launch.train"  # python -m axonn_launch.train <job_dir>: one rank
ZYGOTE = "axonn_launch.train.zygote"  # the warm start's process (job side: torch)
# ``python -m ZYGOTE ...`` with the garbage collector off from the first import on: the
# imports make some 470,000 objects and little garbage (2%), and collecting while they
# were made took 15-20% of their time (``python -m`` imports the module's package, and
# torch with it, before any line of the module runs). The zygote freezes those objects
# and turns the collector on again before it forks.
ZYGOTE_BOOT = (
    "import gc, runpy, sys; gc.disable(); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)
RANK_START_VAR = "AXONN_RANK_START"  # "exec": every rank starts Python afresh
EARLY = "early"  # the supervisor's second argument when it starts before its job is composed
BLANK = " " * 1024  # the argument that the job dir, once known, is written over (ps shows it)
# Set again in each rank (``train.configure_threads``), so the warm start may import without
# the value the job gives them; any other difference makes the supervisor import afresh.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
GO = b"go\n"  # the launcher's word that job.json names the supervisor: start the ranks
GRACE_S = 10.0  # SIGTERM, then SIGKILL after this: every rank is gone well within 30 s
POLL_S = 0.05  # the first rank to end is told from the others by this
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What a rank takes as "save a checkpoint at the next step boundary, then stop"
# (train/__main__.py), as a Slurm task does: sent on a first Ctrl-C (SIGINT).
SAVE_AND_STOP = signal.SIGUSR2
PR_SET_PDEATHSIG = 1
FINAL_STATES = ("completed", "failed")  # what job.json says once the supervisor ended


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(
    *,
    rank: int,
    world_size: int,
    port: int,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one local rank process: ``base`` (default: this process's),
    ``extra``, then the torchrun-style rendezvous variables."""
    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def starting_line(world_size: int, *, detached: bool = False) -> str:
    """Printed as the ranks start: until rank 0 logs, seconds pass (a minute and more on
    a run whose Python has no compiled bytecode yet: the first after a plain install)."""
    wait = "" if bytecode_cached() else "; the first run compiles Python: up to a minute"
    where = "each logs to" if detached else "rank 0 logs here, the others to"
    return f"starting {world_size} ranks ({where} logs/rank_<N>.log){wait}"


def bytecode_cached(modules: tuple[str, ...] = ("torch", "axonn_launch.train")) -> bool:
    """Whether the packages the ranks import have their ``__pycache__`` (compiled by
    machines/local/setup.sh, or by an earlier run); looked up without importing them."""
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        origin = spec.origin if spec else None
        if not origin or not os.path.exists(importlib.util.cache_from_source(origin)):
            return False
    return True


# --- the supervisor's side: the ranks ------------------------------------------------------


def start_ranks(
    *,
    job_dir: Path,
    world_size: int,
    env: Mapping[str, str] | None = None,
    warm: WarmStart | None = None,
    stop_requested: Callable[[], str] = lambda: "",
) -> list[subprocess.Popen] | list[ForkedRank]:
    """Start every rank; each dies with this process (the supervisor).

    Rank 0 keeps this process's output: the launcher's terminal when it waits, the console
    file of a detached job (``start_supervisor``). The others' output goes to
    <job_dir>/logs/rank_<N>.log, opened for appending: each rank's logging (train/logs.py)
    appends its lines there too. With ``warm`` (a warm start), the ranks are forked from a
    process that has imported the job side already; else, or when that process could not
    start them (``WarmStart.start``), each is ``python -m axonn_launch.train``.
    """
    paths = JobPaths(job_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = range(world_size)
    envs = [rank_env(rank=r, world_size=world_size, port=port, extra=env) for r in ranks]
    logs = [None] + [paths.rank_log(rank) for rank in range(1, world_size)]
    argv = [RANK_MODULE, str(job_dir)]
    forked = None if warm is None else warm.start(argv, envs, logs, stop_requested, job_dir)
    if forked is not None:
        return forked
    command = [sys.executable, "-m", *argv]
    procs = []
    for rank_env_, log in zip(envs, logs):
        with contextlib.ExitStack() as files:
            out = None if log is None else files.enter_context(open(log, "a"))
            procs.append(
                subprocess.Popen(
                    command,
                    env=rank_env_,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    preexec_fn=die_with(os.getpid()),
                )
            )
    return procs


# --- the warm start: ranks forked from one process that imported the job side ---------------


def warm_start_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether local ranks are forked from a warm process (default) or each starts Python
    afresh (``AXONN_RANK_START=exec``: the way before the warm start, kept for comparison
    and as a way out)."""
    return environ.get(RANK_START_VAR, "fork") != "exec"


class WarmStart:
    """A ``python -m axonn_launch.train.zygote`` of this process (``ZYGOTE_BOOT``: the
    same, with the collector off while it imports): it imports the job side
    as soon as it is made (while the launcher still writes job.json), then forks the ranks
    that ``start`` names and reports on a pipe when each starts and ends. It dies with this
    process, and its ranks with it."""

    def __init__(
        self, job_dir: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        read_end, write_end = os.pipe()
        environ = dict(os.environ if env is None else env)
        # numpy's OpenBLAS (loaded with torch) would start a thread per core but one: the
        # zygote must fork from one thread. The ranks' own environments are as given.
        environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE_BOOT, ZYGOTE, str(job_dir), str(write_end)],
            env=environ,
            cwd=cwd,
            stdin=subprocess.PIPE,
            pass_fds=(write_end,),
            preexec_fn=die_with(os.getpid()),
        )
        os.close(write_end)
        self.reports = os.fdopen(read_end, "r")
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}  # rank -> pid
        self.codes: dict[int, int] = {}  # pid -> return code
        self.gone = False
        self.reported = 0  # lines read from the zygote: a waiter wakes when this changes
        self.threads = 0  # the zygote's threads once its imports were done (1 expected)
        self.refused = ""  # its one line when it would not fork (more than one thread)
        self.reader = threading.Thread(target=self.read_reports, daemon=True)
        self.reader.start()

    def read_reports(self) -> None:
        for line in self.reports:
            word, *values = line.split()
            with self.changed:
                if word == "ready":
                    self.threads = int(values[0])
                elif word == "started":
                    self.pids[int(values[0])] = int(values[1])
                elif word == "ended":
                    self.codes[int(values[0])] = int(values[1])
                elif word == "refused":
                    self.refused = line.split(" ", 1)[1].strip()
                self.reported += 1
                self.changed.notify_all()
        with self.changed:
            self.gone = True  # its ranks died with it (parent-death signal): SIGKILL
            for pid in self.pids.values():
                self.codes.setdefault(pid, -signal.SIGKILL)
            self.reported += 1
            self.changed.notify_all()

    def wait_report(self, seen: int, timeout: float) -> None:
        """Until the zygote has reported more than ``seen`` lines (or ended), or ``timeout``."""
        with self.changed:
            self.changed.wait_for(lambda: self.reported != seen, timeout)

    def start(
        self,
        argv: list[str],
        envs: list[dict],
        logs: list[Path | tuple[Path, Path] | None],
        stop_requested: Callable[[], str] = lambda: "",
        job_dir: Path | None = None,
    ) -> list[ForkedRank] | None:
        """Fork one rank per environment, each running ``python -m`` ``argv`` (a module and
        its arguments), its output to its log (a path; stdout and stderr apart; None: this
        process's); returns once each has its pid. A zygote started before its job was
        known (``BLANK`` for its job dir) names ``job_dir`` from then on. None when the
        zygote ended first (it could not import the job side: each rank then starts
        afresh, and fails on its own, in its own log; or it refused to fork with more than
        one thread, said in one line naming them) or a stop was asked for while it was
        still importing (it is killed: fresh ranks then meet the stop at once)."""
        ranks = [
            {"rank": r, "env": env, **output_of(log)}
            for r, (env, log) in enumerate(zip(envs, logs))
        ]
        named = {"job_dir": str(job_dir)} if job_dir is not None else {}
        order = json.dumps({"argv": argv, "ranks": ranks, **named}) + "\n"
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.write(order.encode())
            self.process.stdin.close()
        with self.changed:
            while not (len(self.pids) == len(envs) or self.gone or stop_requested()):
                self.changed.wait(timeout=POLL_S * 5)
        if len(self.pids) < len(envs):
            self.close(kill=True)
            if self.refused:
                print(f"supervisor: {self.refused}", file=sys.stderr, flush=True)
            return None
        return [ForkedRank(self, self.pids[rank]) for rank in range(len(envs))]

    def close(self, *, kill: bool = False) -> None:
        """All its ranks have ended: let it go; ``kill``: at once (no ranks to start, the
        job was abandoned or stopped)."""
        if kill and self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(OSError):
            if self.process.stdin is not None and not self.process.stdin.closed:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def output_of(log: Path | tuple[Path, Path] | None) -> dict[str, str]:
    """A rank's output in the zygote's words: ``log`` or ``stdout``/``stderr``."""
    if log is None:
        return {}
    if isinstance(log, tuple):
        return {"stdout": str(log[0]), "stderr": str(log[1])}
    return {"log": str(log)}


class ForkedRank:
    """One rank forked by a ``WarmStart``, seen as a ``subprocess.Popen`` is (pid, poll,
    wait, send_signal, kill, returncode): its return code comes from the zygote's report."""

    def __init__(self, warm: WarmStart, pid: int) -> None:
        self.warm = warm
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.warm.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.warm.changed:
            if not self.warm.changed.wait_for(lambda: self.pid in self.warm.codes, timeout):
                raise subprocess.TimeoutExpired(ZYGOTE, timeout or 0)
        return self.warm.codes[self.pid]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def die_with(parent: int) -> Callable[[], None]:
    """A Popen ``preexec_fn``: the child gets SIGKILL when ``parent`` ends (Linux), and ends
    at once if ``parent`` is already gone."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@dataclass(frozen=True)
class Ending:
    """How the ranks ended.

    ``codes``: each rank's return code (negative: killed by that signal); ``failed``: the
    ranks that had failed when the supervisor saw the first failure, with their codes then
    (the others were still running, or had exited 0); ``stopped_by``: the signal that asked
    the supervisor to stop them ("" when none did).
    """

    codes: tuple[int, ...]
    failed: dict[int, int] = field(default_factory=dict)
    stopped_by: str = ""
    saved_step: int | None = None  # a save-and-stop's checkpoint (``with_saved_step``)

    @property
    def cause(self) -> int | None:
        """The rank whose end ended the job: one killed by a signal before the others
        (its peers then fail on lost connections), else the first to fail; None if none."""
        killed = sorted(
            (rank for rank, code in self.failed.items() if code < 0),
            key=lambda rank: self.failed[rank] != -signal.SIGKILL,  # kill -9, the OOM killer
        )
        return (killed or list(self.failed) or [None])[0]

    @property
    def exit_code(self) -> int:
        """The job's: 0; the cause's code (128+N for signal N, as a shell says it); or
        128+N when signal N stopped the job."""
        if self.cause is not None:
            return shell_code(self.failed[self.cause])
        if self.stopped_by:
            return 128 + int(signal.Signals[self.stopped_by])
        return shell_code(next((c for c in self.codes if c), 0))

    def describe(self, pids: list[int]) -> str:
        """One line: what ended the job, and what the supervisor did about it."""
        others = [r for r, c in enumerate(self.codes) if r not in self.failed and c != 0]
        stopped = f": stopped rank{'s' if len(others) != 1 else ''} {ranks_text(others)}"
        tail = stopped if others else ""
        if self.cause is None and self.saved_step is not None:
            return (
                f"{self.stopped_by}: stopped by the user after step {self.saved_step}, its"
                " checkpoint saved (jobs resubmit resumes from it)"
            )
        if self.cause is None:
            return f"{self.stopped_by}: stopped ranks {ranks_text(others)}"
        return f"{rank_end(self.cause, pids[self.cause], self.failed[self.cause])}{tail}"


def shell_code(code: int) -> int:
    return code if code >= 0 else 128 - code


def rank_end(rank: int, pid: int, code: int) -> str:
    """``rank 2 (pid 41) was killed by SIGKILL`` or ``rank 1 (pid 40) exited with code 1``."""
    if code < 0:
        return f"rank {rank} (pid {pid}) was killed by {signal_name(-code)}"
    return f"rank {rank} (pid {pid}) exited with code {code}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def wait_ranks(
    procs: list[subprocess.Popen],
    stop_requested: Callable[[], str],
    saving: Callable[[], bool] = lambda: False,
) -> Ending:
    """Wait for all ranks; when one fails, or ``stop_requested()`` names a signal, stop the
    rest (as srun --kill-on-bad-exit does). While ``saving()`` says so (a first Ctrl-C),
    a stop asks every rank to save at the next step boundary and stop (``SAVE_AND_STOP``)
    and waits for them; a rank that ended by that signal had not yet set up its handler
    (still starting): there is nothing to save, and the rest are stopped at once."""
    warm = procs[0].warm if procs and isinstance(procs[0], ForkedRank) else None
    told = False
    while True:
        seen = warm.reported if warm else 0
        codes = [p.poll() for p in procs]
        asked = stop_requested()
        if asked and saving() and not told:
            told = ask_to_save(procs, asked)
        unready = told and -SAVE_AND_STOP in codes
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0, -SAVE_AND_STOP)}
        failed |= {} if told else {r: c for r, c in enumerate(codes) if c == -SAVE_AND_STOP}
        if failed or (asked and not (told and saving() and not unready)):
            stop(procs)
            return Ending(tuple(p.returncode for p in procs), failed, "" if failed else asked)
        if all(c == 0 for c in codes):
            return Ending(tuple(codes), stopped_by=asked if told else "")
        pause(warm, seen)


def ask_to_save(procs: list[subprocess.Popen], asked: str) -> bool:
    """Send ``SAVE_AND_STOP`` to every rank, and say so in one line (the console)."""
    for p in procs:
        p.send_signal(SAVE_AND_STOP)
    print(
        f"supervisor: {asked}: saving a checkpoint at the next step boundary, then stopping"
        " (Ctrl-C again stops at once)",
        file=sys.stderr,
        flush=True,
    )
    return True


def with_saved_step(ending: Ending, job_dir: Path) -> Ending:
    """A save-and-stop's ending with the step its checkpoint holds, from rank 0's
    summary.json; an ending whose training finished anyway (the stop came after its last
    step: the sample) is a plain completed one."""
    if ending.cause is not None or not ending.stopped_by or any(ending.codes):
        return ending
    summary = read_summary(job_dir) or {}
    if not summary.get("stopped"):
        return Ending(ending.codes)
    return replace(ending, saved_step=int(summary.get("steps", 0)))


def pause(warm: WarmStart | None, seen: int) -> None:
    """``POLL_S``; with forked ranks, less once the zygote reports more than ``seen``
    lines (a rank's end is seen as soon as it is reported)."""
    if warm is None:
        time.sleep(POLL_S)
    else:
        warm.wait_report(seen, POLL_S)


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every rank still running, SIGKILL to those left after ``grace_s``; all
    are reaped before this returns."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- the launcher's side: the supervisor ---------------------------------------------------


def start_supervisor(
    *,
    job_dir: Path,
    world_size: int,
    env: Mapping[str, str],
    console: Path | None = None,
) -> subprocess.Popen:
    """The supervisor of one local job, in a session of its own (a Ctrl-C or a closed
    terminal reaches the launcher, which passes it on, never the ranks directly). It waits
    for ``release`` before it starts the ranks. ``console``: the file that gets its output
    and rank 0's (a detached job: nobody reads the terminal); None: this terminal. One
    that ``start_early_supervisor`` started is given the job if it can take it."""
    early, EARLY_SUPERVISOR[:] = EARLY_SUPERVISOR[:], []
    for supervisor in early:
        if hand_job(supervisor, job_dir, world_size, {**os.environ, **env}, console):
            return supervisor
    command = [sys.executable, "-m", SUPERVISOR, str(job_dir), str(world_size)]
    with contextlib.ExitStack() as files:
        out = None
        if console is not None:
            console.parent.mkdir(parents=True, exist_ok=True)
            out = files.enter_context(open(console, "a"))
        return subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )


# --- the launcher's side: a supervisor started before the job is composed -------------------

EARLY_SUPERVISOR: list[subprocess.Popen] = []  # the one start_early_supervisor started


def start_early_supervisor(argv: list[str]) -> None:
    """Start a local job's supervisor, and with it the warm start's imports, while the
    launcher composes and checks the job (half a second to a second): ``start_supervisor``
    hands it the job then. Only for a command line that may run one local job
    (``early_start_wanted``); a launcher that ends without a local job (bad input, a dry
    run) ends it by ending: the supervisor reads the end of its input, stops its imports
    and ends, writing nothing. Called twice (``python -m axonn_launch`` calls it before
    it imports the launcher, and the launcher's ``main`` again), it starts one."""
    if not EARLY_SUPERVISOR and early_start_wanted(argv):
        command = [sys.executable, "-m", SUPERVISOR, BLANK, EARLY]
        EARLY_SUPERVISOR.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
        )


def dismiss_early_supervisor() -> None:
    """End the early supervisor, if any, without a job (a launch that turned out to start
    none here: its imports stop now, not when the launcher ends)."""
    early, EARLY_SUPERVISOR[:] = EARLY_SUPERVISOR[:], []
    for supervisor in early:
        with contextlib.suppress(OSError):
            supervisor.stdin.close()


def early_start_wanted(argv: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """A plain run (no flag: no sweep, no help, no other config) of a job on this computer
    (``machine=local`` or no machine given) that the launcher waits for (a detached job's
    supervisor writes to a file), not a dry run or a rehearsal; Linux, with the warm start."""
    if not sys.platform.startswith("linux") or not warm_start_wanted(environ):
        return False
    if any(arg.startswith("-") for arg in argv):
        return False
    said = dict(arg.lstrip("+~").split("=", 1) for arg in argv if "=" in arg)
    yes, no = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
    return (
        said.get("machine", "local") == "local"
        and said.get("dry_run", "").lower() not in yes
        and said.get("rehearse", "").lower() not in yes
        and said.get("wait", "").lower() not in no
    )


def hand_job(
    supervisor: subprocess.Popen,
    job_dir: Path,
    world_size: int,
    env: Mapping[str, str],
    console: Path | None,
) -> bool:
    """Give an early supervisor its job (a JSON line); False, and it ends, when it cannot
    take it: a detached job (its output is the terminal's), a job dir longer than
    ``BLANK``, or it ended already."""
    fits = console is None and len(str(job_dir).encode()) <= len(BLANK)
    job = {"job_dir": str(job_dir), "world_size": world_size, "env": dict(env)}
    assert supervisor.stdin is not None
    try:
        if fits and supervisor.poll() is None:
            supervisor.stdin.write((json.dumps(job) + "\n").encode())
            supervisor.stdin.flush()
            return True
        supervisor.stdin.close()
    except OSError:  # it ended
        pass
    return False


def release(supervisor: subprocess.Popen) -> None:
    """Let the supervisor start the ranks: job.json names it now."""
    assert supervisor.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        supervisor.stdin.write(GO)
        supervisor.stdin.close()


def passing_stop_signals(supervisor: subprocess.Popen) -> contextlib.AbstractContextManager:
    """While inside, SIGINT, SIGTERM and SIGHUP to this process go to the supervisor, which
    stops the ranks, records the job and ends."""
    return forwarding_stop_signals(supervisor.send_signal)


def passing_stop_signals_to_run(
    attempts: Callable[[], list[Path]],
) -> contextlib.AbstractContextManager:
    """While inside, SIGINT, SIGTERM and SIGHUP to this process go to every live supervisor
    of a run's ``attempts()`` (a waiting launcher following a run with recovery on): the
    one at work stops its ranks, or its recovery step, and the run (``supervise.py``)."""

    return forwarding_stop_signals(lambda signum: bool(signal_supervisors(attempts(), signum)))


def signal_supervisors(job_dirs: list[Path], signum: int) -> list[int]:
    """Send ``signum`` to the live supervisors of these job dirs; the pids it went to."""
    pids = live_supervisors(job_dirs)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return pids


def live_supervisors(job_dirs: list[Path]) -> list[int]:
    """The pids of the supervisors still running for these job dirs (job.json's
    ``local-<pid>``, checked in /proc: a pid reused by another process is not one)."""
    pids = []
    for job_dir in job_dirs:
        job_id = last_job_id(read_record_or_empty(job_dir))
        if not job_id.startswith("local-"):
            continue
        pid = job_id.removeprefix("local-")
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if SUPERVISOR in argv and str(Path(job_dir).resolve()) in argv:
            pids.append(int(pid))
    return pids


@contextlib.contextmanager
def forwarding_stop_signals(send: Callable[[int], bool | None]) -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP to this process are given to ``send``; one
    it says False to (nobody to pass it to) acts as it would outside."""
    previous: dict[int, object] = {}

    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            if send(signum) is False:
                signal.signal(signum, previous[signum] or signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    if threading.current_thread() is not threading.main_thread():  # only it gets signals
        yield
        return
    previous.update({sig: signal.signal(sig, forward) for sig in STOP_SIGNALS})
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_supervisor(supervisor: subprocess.Popen) -> int:
    """The job's exit code, as the supervisor returns it (128+N if signal N killed it)."""
    return shell_code(supervisor.wait())
