"""``python -m MODULE ARGS`` inside a process forked from one that imported it already: the
run and the end a fresh interpreter would give. Used by the warm start's zygote for each
rank (``train/zygote.py``) and by the tests' launcher fork server (``tests/cli_server.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable


def fork_as_main(prepare: Callable[[], None], module: str, args: list[str]) -> int:
    """Fork a child that runs ``prepare()`` (its own output, environment, signals), then
    ``module`` as ``__main__`` with ``args``, and ends as an interpreter would; the parent
    gets the child's pid, the child never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        prepare()
        code = run_as_main(module, args)
    except BaseException:
        traceback.print_exc()  # the preparation failed: code 1
    finally:
        finish(code)
    raise AssertionError("unreachable")


def run_as_main(module: str, args: list[str]) -> int:
    """Run ``module`` as ``__main__`` with ``args``; the exit code Python would give (an
    uncaught KeyboardInterrupt ends the process at once, by SIGINT, as Python does)."""
    sys.argv = ["-m", *args]  # runpy puts the module's path first, as ``python -m`` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        return exit_code_of(stop)
    except KeyboardInterrupt:
        uncaught()
        finish(-signal.SIGINT)
    except BaseException:
        uncaught()
        return 1
    return 0


def uncaught() -> None:
    """Report the exception being handled as the interpreter reports an uncaught one: through
    ``sys.excepthook`` (torch.distributed's prefixes each line with ``[rank<N>]:``)."""
    try:
        sys.excepthook(*sys.exc_info())
    except BaseException:
        traceback.print_exc()


def exit_code_of(stop: SystemExit) -> int:
    """The exit code of an uncaught ``SystemExit`` (a message: printed, code 1)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def finish(code: int) -> None:
    """End as an interpreter ends: wait for its threads (and run threading's exit hooks, where
    ``concurrent.futures`` and joblib's loky stop their workers), run its exit handlers
    (``multiprocessing`` joins its children there), flush its output, and exit with ``code``
    (a negative one: die by that signal)."""
    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
