"""``python -m axonn_launch.train.zygote JOB_DIR REPORT_FD``: the warm start of a local job's ranks.

Every rank of a local job imports torch and the job side: about 3 CPU-seconds each, which
on a laptop with fewer cores than ranks is most of a short job's wall time. This process
pays that once, then forks one process per rank. Slurm jobs do not use it: srun starts
their tasks.

Its imports are those of every rank that starts Python afresh too (a Slurm task, ``python
-m axonn_launch.train``), made the same way: ``RANK_IMPORTS`` through ``import_frozen``.
With the collector on, the heap's growth during those imports (some 260,000 objects) sets
off full collections that scan everything imported so far, and the interpreter's teardown
at the rank's exit scans it all again and runs some 170 finalizers that undo
torch.library's operator registrations: on this project's 2-core machine, 1.3 of the 3.55
CPU-seconds of a Slurm task that trains two steps (BENCHMARKS.md, "A rank's imports: the
collector off, then frozen").

The order it reads, what each rank inherits and the report protocol: ``docs/launch.md``
("train/zygote.py").
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import signal
import sys
import threading
import weakref
from pathlib import Path

from axonn_launch.common.asmain import fork_as_main
from axonn_launch.common.proctitle import rename_argument

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
RANK_NAME = "axonn-rank-{rank}"  # the process name of a forked rank (15 bytes at most)
ZYGOTE_NAME = "axonn-zygote"
TASKS = "/proc/self/task"  # one entry per thread of this process (Linux)
# What a rank imports on its way to its first step: imported once, before the first step
# (or the zygote's fork), not a module a rank runs as __main__ (runpy warns when that is
# imported already)
RANK_IMPORTS = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.nn.functional",
    "torch.utils.checkpoint",
    "numpy",
    "axonn_launch.train",
    "axonn_launch.train.run",  # axonn_launch.train imports it only when a rank runs
    "axonn_launch.train.health.faults",
    "axonn_launch.train.checkpoint.export",
    "axonn_launch.train.checkpoint.state",  # checkpoints
    "torch.utils.serialization",  # torch.save
)


def import_frozen(modules: tuple[str, ...]) -> None:
    """Import ``modules`` with the collector off, keep torch.library's registrations at
    exit (``keep_registrations_at_exit``), and freeze every object made so far
    (``gc.freeze``): no later collection in this process or a child forked from it scans
    them. Nothing is done when they are all imported already (a rank forked by the zygote).

    The cyclic garbage made while importing (some 7,000 objects, a few hundred kB) is
    frozen with the rest, not freed; a collection to free it would cost a full scan."""
    if all(name in sys.modules for name in modules):
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            importlib.import_module(name)
        keep_registrations_at_exit()
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def keep_registrations_at_exit() -> None:
    """Turn off the exit-time run of the finalizers that undo torch.library's operator
    registrations made by the imports (some 170, one per library): each rank ran them
    all at its exit, 0.13 s of CPU, only to unregister operators in a process that is
    ending. The ranks' own registrations are undone as before."""
    for finalizer in list(weakref.finalize._registry):  # private: there is no public list
        found = finalizer.peek()
        if found is not None and getattr(found[1], "__module__", "") == "torch.library":
            finalizer.atexit = False


def set_process_name(name: str) -> None:
    """The name ``ps -o comm`` and ``top`` show (Linux; 15 bytes kept)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def die_with_parent() -> None:
    """SIGKILL when the parent ends (Linux); end at once if it already has."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def preload(modules: tuple[str, ...] = RANK_IMPORTS) -> int:
    """Import ``modules``; the number of threads this process has then (1: safe to fork).

    numpy's OpenBLAS starts its worker threads when it is loaded (one per core but one),
    and torch loads numpy, before this module runs (``axonn_launch.train`` imports torch);
    the ranks do no BLAS work in numpy (torch has its own pools, sized in each rank), so
    the supervisor starts this process with ``OPENBLAS_NUM_THREADS=1`` unless the user set
    it (``scheduler/processes.py``).

    The imports are made as every rank that starts afresh makes them (``import_frozen``):
    the collector off while importing (the supervisor starts this process with it off
    already: ``scheduler/processes.py``'s ``ZYGOTE_BOOT``), and the objects they made
    frozen, so that no rank's collection scans them again (a full one took each rank 0.5 s
    at its end, and wrote to every page it shares with the zygote); the collector is on
    for the ranks."""
    try:
        import_frozen(modules)
    finally:
        gc.enable()
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def start_rank(argv: list[str], item: dict, closing: list[int]) -> int:
    """Fork the rank ``item`` names; the parent gets its pid, the child never returns."""
    module, *args = argv
    return fork_as_main(lambda: become_rank(item, closing), module, args)


def become_rank(item: dict, closing: list[int]) -> None:
    """The child's side of the fork: what a fresh ``python -m ...`` has, with the rank's
    name, environment and output (``log``: stdout and stderr to that file; or ``stdout``
    and ``stderr`` apart; neither: the zygote's, which is the supervisor's)."""
    set_process_name(RANK_NAME.format(rank=item["rank"]))
    for fd in closing:
        with contextlib.suppress(OSError):
            os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent()
    replace_fd(os.open(os.devnull, os.O_RDONLY), 0)
    out, err = item.get("stdout") or item.get("log"), item.get("stderr") or item.get("log")
    for path, target in ((out, 1), (err, 2)):
        if path is not None:
            replace_fd(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), target)
    os.environ.clear()
    os.environ.update(item["env"])


def replace_fd(fd: int, target: int) -> None:
    if fd != target:
        os.dup2(fd, target)
        os.close(fd)


def report(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def wait_all(pids: set[int], fd: int) -> None:
    while pids:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return
        if pid in pids:
            pids.discard(pid)
            report(fd, f"ended {pid} {os.waitstatus_to_exitcode(status)}")


def other_threads() -> list[str]:
    """Every thread of this process but the calling one, named: a Python thread as
    ``<name> (ident <ident>, tid <tid>)``, a native one (a library's pool) as
    ``<comm> (tid <tid>)`` (``/proc/self/task``, where Linux lists them all)."""
    me = threading.get_native_id()
    python = {t.native_id: t for t in threading.enumerate() if t.native_id != me}
    tids = [int(t) for t in os.listdir(TASKS)] if os.path.isdir(TASKS) else list(python)
    named = []
    for tid in sorted(set(tids) | set(python)):
        if tid == me:
            continue
        found = python.get(tid)
        named.append(
            f"{found.name} (ident {found.ident}, tid {tid})" if found else native_name(tid)
        )
    return named


def native_name(tid: int) -> str:
    try:
        comm = Path(f"{TASKS}/{tid}/comm").read_text().strip()
    except OSError:
        comm = "a thread that ended"
    return f"{comm} (tid {tid})"


def refusal(threads: list[str]) -> str:
    """The one line of a zygote that will not fork: which threads it has besides its own."""
    named = ", ".join(threads)
    return (
        f"warm start refused: the zygote has {len(threads) + 1} threads, not 1 ({named});"
        " forking would copy them mid-work: starting each rank afresh"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd = int(argv[1])
    set_process_name(ZYGOTE_NAME)
    die_with_parent()
    threads = preload()
    report(fd, f"ready {threads}")
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the supervisor ended, or abandoned the job before the ranks started
    order = json.loads(line)
    threads = other_threads()
    if threads:  # a fork copies no thread but this one: the others' locks stay held
        report(fd, f"refused {refusal(threads)}")
        return 0
    name_job(argv[0], order.get("job_dir"))
    closing = [fd]
    pids = set()
    for item in order["ranks"]:
        pid = start_rank(order["argv"], item, closing)
        pids.add(pid)
        report(fd, f"started {item['rank']} {pid}")
    wait_all(pids, fd)
    return 0


def name_job(named: str, job_dir: str | None) -> None:
    """A zygote started before its job was composed has a blank job dir argument: it shows
    ``job_dir`` from now on, and so do the ranks it forks (``ps``, /proc/<pid>/cmdline)."""
    if job_dir and not named.strip():
        rename_argument(named, job_dir)


def leave(code: int) -> None:
    """Exit with ``code`` once the output is flushed, without the interpreter's teardown:
    with torch imported that took this process 0.25 s after its last rank ended, and it has
    nothing to clean up (it only imported; each rank ran its own exit handlers)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
