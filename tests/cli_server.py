"""``python -m MODULE ARGS`` for the tests, forked from one process that imported the login
side already.

About 300 tests run the launcher and its commands as a user would: a fresh
``python -m axonn_launch ...`` each, which spends about half a CPU-second importing Hydra,
OmegaConf, submitit and the login wing before it composes anything. ``run_module`` gives
the same process a test would get from ``subprocess.run([sys.executable, "-m", MODULE,
*ARGS], cwd=..., env=..., capture_output=True, text=True, timeout=...)``, but forked from
a server (one per pytest process) that imported those modules once (``PRELOAD``; never
torch: the login wing must stay free of it, and tests check that it does).

What the child gets, as a fresh interpreter would have it: the environment given (the
caller's by default), the working directory, ``sys.argv`` and ``sys.path[0]`` of
``python -m`` run there, stdin from /dev/null, stdout and stderr on pipes of the caller's
(passed over a Unix socket, so that reading them ends when every process holding them has
closed them, as ``communicate`` does), default signal handlers, exit handlers run at exit,
and the exit code an interpreter gives (negative: killed by a signal). State that
CPython fixes at start-up from the environment (``PYTHON*``, the locale) cannot change
after the fork, so a call whose environment differs there from the server's starts a real
interpreter instead, as does every call when the server cannot start.

The server is single-threaded (it forks), reads requests as JSON lines with two file
descriptors attached, and reports ``started <id> <pid>`` and ``ended <id> <code>``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from axonn_launch.common.asmain import fork_as_main

REPO = Path(__file__).resolve().parent.parent
PRELOAD = (
    "hydra",
    "hydra.main",
    "hydra.utils",
    "hydra._internal.utils",
    "hydra._internal.hydra",
    "hydra._internal.config_loader_impl",
    "hydra.core.utils",
    "omegaconf",
    "submitit",
    "yaml",
    "axonn_launch.cli",
    "axonn_launch.jobs",
    "axonn_launch.plan",
    "axonn_launch.report",
    "axonn_launch.study",
)
STARTUP_VARS = ("PYTHON", "LC_", "LANG")  # read once by CPython as it starts


# --- the server -----------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Fork a child per request until the socket closes; report each child's end."""
    running: dict[int, str] = {}  # pid -> request id
    buffered, pending = b"", []  # a request's two fds arrive with its first bytes
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 64)
            if not data:
                break
            buffered, pending = buffered + data, pending + list(fds)
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                request = json.loads(line)
                mine, pending = pending[:2], pending[2:]
                pid = fork_child(request, mine, sock, pending)
                for fd in mine:
                    os.close(fd)
                running[pid] = request["id"]
                send(sock, f"started {request['id']} {pid}")
        reap(running, sock)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def reap(running: dict[int, str], sock: socket.socket) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in running:
            send(sock, f"ended {running.pop(pid)} {os.waitstatus_to_exitcode(status)}")


def send(sock: socket.socket, line: str) -> None:
    sock.sendall((line + "\n").encode())


def fork_child(request: dict, fds: list[int], sock: socket.socket, others: list[int]) -> int:
    """Fork the child ``request`` names, its output on ``fds``; ``others``: fds of other
    requests, which the child must not hold open. It runs and ends as an interpreter would
    (``common/asmain.py``)."""

    def prepare() -> None:
        sock.close()
        for fd in others:
            os.close(fd)
        become_child(request, fds)

    return fork_as_main(prepare, request["module"], request["args"])


def become_child(request: dict, fds: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # python -m puts the working directory first


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    send(sock, "ready")
    serve(sock)


# --- the client -----------------------------------------------------------------------------


class Server:
    """The calling process's handle on its server: started on first use, shared by threads."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_server", str(theirs.fileno())],
            cwd=REPO,
            env=self.env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.alive = self.read_line() == "ready"
        self.count = 0
        self.buffered = ""
        threading.Thread(target=self.read_reports, daemon=True).start()

    def read_line(self) -> str:
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.sock.recv(1)
            if not chunk:
                return ""
            line += chunk
        return line.decode().strip()

    def read_reports(self) -> None:
        for line in self.sock.makefile("r"):
            word, request, value = line.split()
            with self.changed:
                (self.pids if word == "started" else self.codes)[request] = int(value)
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def can_run(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` is what a fresh interpreter with it would be."""

        def startup(environ: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in environ.items() if k.startswith(STARTUP_VARS)}

        return self.alive and startup(env) == startup(self.env)

    def run(self, module: str, args: list[str], cwd: Path | str, env: dict, timeout: float):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with self.lock:
            self.count += 1
            request = str(self.count)
            message = {"id": request, "module": module, "args": args, "cwd": str(cwd),
                       "env": env}  # fmt: skip
            socket.send_fds(self.sock, [(json.dumps(message) + "\n").encode()], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        return self.collect(request, out_r, err_r, timeout)

    def collect(self, request: str, out_r: int, err_r: int, timeout: float):
        outputs: dict[int, bytes] = {}
        readers = [threading.Thread(target=read_all, args=(fd, outputs)) for fd in (out_r, err_r)]
        for reader in readers:
            reader.start()
        with self.changed:
            ended = self.changed.wait_for(lambda: request in self.codes or not self.alive, timeout)
            pid = self.pids.get(request)
        if not ended and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for reader in readers:
            reader.join()
        return ended, self.codes.pop(request, None), outputs[out_r], outputs[err_r]


def read_all(fd: int, into: dict[int, bytes]) -> None:
    chunks = []
    with os.fdopen(fd, "rb") as stream:
        while chunk := stream.read(65536):
            chunks.append(chunk)
    into[fd] = b"".join(chunks)


_SERVER: Server | None = None
_SERVER_LOCK = threading.Lock()


def server() -> Server | None:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive:
            try:
                _SERVER = Server()
            except OSError:
                return None
        return _SERVER


def run_module(
    module: str,
    args: list[str],
    *,
    cwd: Path | str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)`` returns (or raises), from a fork of
    the preloaded server when it can give the same."""
    command = [sys.executable, "-m", module, *args]
    env = dict(os.environ if env is None else env)
    serving = server()
    if serving is None or not serving.can_run(env):
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    ended, code, out, err = serving.run(module, list(args), cwd, env, timeout)
    stdout, stderr = text_of(out), text_of(err)
    if not ended:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    if code is None:
        raise RuntimeError(f"the test CLI server ended while running {shlex.join(command)}")
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def text_of(data: bytes) -> str:
    """As ``text=True`` decodes: UTF-8 here, with universal newlines."""
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    main()
