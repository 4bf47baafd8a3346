"""Atomic, asynchronous DCP checkpoints under ``<job_dir>/checkpoints``.

A save writes a temporary step directory through ``dcp.async_save`` (training goes on
during the write) and only then moves ``latest``, so a crash at any point leaves
``latest`` naming a complete checkpoint. A resume verifies the step it is given
(``resume_point``, ``checkpoint_problem``) and falls back to the newest complete one.
``AXONN_CHECKPOINT_FAULT`` kills a save at a chosen point (tests).

The layout, the order of a save, the fault points and the checks of a resume:
``docs/checkpoints.md`` ("train/checkpoint/manager.py").
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from axonn_launch.common.formats import DCP_FORMAT, LEGACY_FORMAT
from axonn_launch.common.fserrors import file_system_line
from axonn_launch.common.jobdir import (
    INTERRUPTED_SAVES,
    LATEST,
    STEP_META,
    JobPaths,
    latest_step_name,
)
from axonn_launch.train.parallel.shards import (
    CountingReader,
    ShardLoadPlanner,
    ShardSavePlanner,
    ShardSpec,
)

FORMAT = DCP_FORMAT
FAULT_ENV = "AXONN_CHECKPOINT_FAULT"
FAULT_POINTS = ("write", "metadata", "rename")
STEP_DIR = re.compile(r"step_(\d+)")

log = logging.getLogger(__name__)


def checkpoint_root(job_dir: Path | str) -> Path:
    return JobPaths(job_dir).checkpoints


def latest_checkpoint(job_dir: Path | str) -> Path | None:
    """The step ``latest`` names (a pointer outside this dir: the newest complete step
    here, ``jobdir.latest_step_name``); None without one."""
    pointer = checkpoint_root(job_dir) / LATEST
    name = latest_step_name(job_dir)
    if name is None:
        return None
    path = checkpoint_root(job_dir) / name
    if not (path / STEP_META).exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing")
    return path


def read_meta(path: Path) -> dict:
    return json.loads((path / STEP_META).read_text())


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def parse_fault(text: str | None) -> tuple[str, int, int] | None:
    """(point, save number, rank) of ``AXONN_CHECKPOINT_FAULT``, or None when unset."""
    if not text:
        return None
    match = re.fullmatch(r"(\w+)@save(\d+)(?::rank(\d+))?", text)
    if not match or match.group(1) not in FAULT_POINTS:
        raise ValueError(
            f"{FAULT_ENV}={text!r}: use POINT@saveN[:rankR] with POINT one of "
            f"{', '.join(FAULT_POINTS)}"
        )
    return match.group(1), int(match.group(2)), int(match.group(3) or 0)


class _FaultPoints:
    def __init__(self, rank: int) -> None:
        self.rank, self.saves = rank, 0
        self.fault = parse_fault(os.environ.get(FAULT_ENV))

    def hit(self, point: str) -> None:
        if self.fault == (point, self.saves, self.rank):
            os.kill(os.getpid(), signal.SIGKILL)


class _Writer(FileSystemWriter):
    """``FileSystemWriter`` with the ``write`` and ``metadata`` fault points."""

    def __init__(self, path: Path, faults: _FaultPoints) -> None:
        super().__init__(path)
        self.faults = faults

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        self.faults.hit("write")
        return result

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.faults.hit("metadata")


class Checkpointer:
    """Saves of one job; collective (every rank calls ``save`` and ``wait`` alike).

    ``group``: a process group with a CPU backend (gloo) that only checkpointing uses,
    or None for a one-process job.
    """

    def __init__(
        self,
        job_dir: Path | str,
        *,
        rank: int,
        keep: int,
        group: dist.ProcessGroup | None = None,
        asynchronous: bool = True,
    ) -> None:
        self.root = checkpoint_root(job_dir)
        self.rank, self.keep, self.group = rank, keep, group
        self.asynchronous = asynchronous
        self.faults = _FaultPoints(rank)
        self._pending: threading.Event | None = None
        self._pending_name = ""
        self._error: BaseException | None = None
        self.last: Path | None = None

    def save(self, step: int, state: dict[str, Any], specs: Mapping[str, ShardSpec],
             meta: dict, replicated: Collection[str] = ()) -> None:  # fmt: skip
        """Start saving ``state`` (sharded keys described by ``specs``; ``replicated``: plain
        tensors the same on every rank, planned by the coordinator alone) as step ``step``."""
        self.wait()
        self.faults.saves += 1
        name = f"step_{step:08d}"
        tmp = self.root / f".tmp_{name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        writer = _Writer(tmp, self.faults)
        planner = ShardSavePlanner(dict(specs), replicated)
        meta = {**meta, "step": step, "format": FORMAT}
        done = threading.Event()
        self._pending, self._pending_name = done, name

        def finalize(future) -> None:
            try:
                future.result()
                if self.rank == 0:
                    self._publish(tmp, name, meta)
                self.last = self.root / name
            except BaseException as error:  # re-raised by wait()
                said = file_system_line(error) or first_line(error)
                log.error("rank %d: checkpoint save of %s failed: %s", self.rank, name, said)
                self._error = error
            finally:
                done.set()

        options = {"storage_writer": writer, "planner": planner, "process_group": self.group,
                   "no_dist": not dist.is_initialized()}  # fmt: skip
        if self.asynchronous:
            future = dcp.async_save(state, **options)
            future.add_done_callback(finalize)
        else:
            from concurrent.futures import Future

            future = Future()
            try:
                dcp.save(state, **options)
                future.set_result(None)
            except BaseException as error:
                future.set_exception(error)
            finalize(future)

    def wait(self) -> Path | None:
        """Block until the save in flight is complete and published; its path (or None)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._barrier()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {error}") from error
        return self.last

    def finish_in_flight(self, timeout_s: float) -> tuple[str, str]:
        """After this rank failed: the save in flight (if any) completes, up to ``timeout_s``.
        Its collectives run on the checkpoint group in every rank's own saving thread, so a
        rank whose training failed alone still completes it with its peers, and rank 0's
        thread publishes it. No barrier: the peers' main threads may never come to one.
        Returns the save's name ('' with none in flight) and what became of it."""
        pending, name = self._pending, self._pending_name
        if pending is None:
            return "", ""
        if not pending.wait(timeout_s):
            return name, f"not complete after {timeout_s:.0f} s"
        self._pending = None
        return name, "failed" if self._error is not None else "complete"

    def _publish(self, tmp: Path, name: str, meta: dict) -> None:
        _atomic_write_text(tmp / STEP_META, json.dumps(meta))
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        self.faults.hit("rename")
        _atomic_write_text(self.root / LATEST, name)
        _prune(self.root, self.keep)

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier(group=self.group)


def first_line(error: BaseException) -> str:
    """``Type: first line`` of an error whose text may hold a whole traceback (DCP's)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def load_state(
    path: Path,
    state: dict[str, Any],
    specs: Mapping[str, ShardSpec],
    *,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Fill ``state`` in place from the DCP checkpoint at ``path``; returns bytes read here.

    Sharded keys read only the saved chunks that overlap this rank's pieces; non-tensor
    values are replaced by the saved objects.
    """
    reader = CountingReader(path)
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist is meant
        dcp.load(
            state,
            storage_reader=reader,
            planner=ShardLoadPlanner(dict(specs)),
            process_group=group,
            no_dist=no_dist,
        )
    return reader.bytes_read


def _atomic_write_text(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(part, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make the renames in directory ``path`` durable: a file system that stops
    committing (ext4 turning read-only on an error, a crash) would otherwise come back
    without them (``latest`` lost, a resume from step 0 beside a complete checkpoint)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_saves(root: Path) -> None:
    """Delete the ``.tmp_step_*`` leftovers of interrupted saves (rank 0, no save in flight)."""
    for stale in root.glob(INTERRUPTED_SAVES):
        shutil.rmtree(stale, ignore_errors=True)


def step_number(path: Path) -> int | None:
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _prune(root: Path, keep: int) -> None:
    """Delete leftovers of interrupted saves and all but the newest ``keep`` complete
    checkpoints up to the one ``latest`` names (``keep <= 0``: keep all). Steps newer than
    ``latest`` (a damaged step a resume fell back from, or one renamed before a crash
    moved ``latest``) are left until a save of that step replaces them or they age out:
    pruning never deletes the step in use."""
    remove_stale_saves(root)
    if keep <= 0:
        return
    current = step_number(named) if (named := pointed_step(root)) is not None else None
    complete = sorted(
        (number, p) for p in root.glob("step_*")
        if (number := step_number(p)) is not None and (p / STEP_META).exists()
        and (current is None or number <= current)
    )  # fmt: skip
    for _, old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_problem(path: Path) -> str | None:
    """What makes the step directory ``path`` unusable, as ``<step dir>/<file>: <what>``, or
    None when it is complete: ``meta.json`` and DCP's ``.metadata`` readable, and every file
    the metadata's items sit in present and at least ``offset + length`` bytes long.
    (Contents are not checksummed: DCP stores no checksums.) A checkpoint of the legacy
    per-rank format is checked for its ``meta.json`` only."""
    name = path.name
    if not path.is_dir():
        return f"{name}: missing"
    try:
        meta = read_meta(path)
    except FileNotFoundError:
        return f"{name}/meta.json: missing"
    except (OSError, ValueError) as error:
        return f"{name}/meta.json: unreadable ({type(error).__name__}: {error})"
    if meta.get("format") == LEGACY_FORMAT:
        return None
    if not (path / ".metadata").exists():
        return f"{name}/.metadata: missing"
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as error:  # a cut pickle raises EOFError, UnpicklingError, ...
        return f"{name}/.metadata: unreadable ({type(error).__name__}: {error})"
    needs: dict[str, int] = {}
    for info in storage.values():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
    for relative, need in sorted(needs.items()):
        problem = _data_file_problem(path / relative, need)
        if problem:
            return f"{name}/{relative}: {problem}"
    return None


def _data_file_problem(file: Path, need: int) -> str | None:
    """``file`` missing, shorter than ``need`` bytes, or failing to read its last byte."""
    try:
        size = file.stat().st_size
        if size < need:
            return f"{size} bytes, metadata needs {need}"
        if need > 0:
            with open(file, "rb") as handle:
                handle.seek(need - 1)
                handle.read(1)
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"read error ({error.strerror or error})"
    return None


def choose_checkpoint(root: Path) -> tuple[Path | None, dict | None]:
    """(step to resume from or None, fallback record or None), checking the step ``latest``
    names and, when it is damaged, falling back to the newest complete older step; moves
    ``latest`` to that step (removes it when there is none: the job starts from step 0,
    as one with no checkpoint does). A ``latest`` that names no step of ``root``
    (``pointed_step``) is ignored the same way, every complete step here a candidate
    (``from_step`` None). Rank 0 only: it logs and writes."""
    pointer = root / LATEST
    if not pointer.exists():
        return None, None
    newest = pointed_step(root)
    if newest is None:  # never followed: every complete step here is a candidate
        text = pointer.read_text(errors="replace").strip()
        problem = f"{LATEST} names {text!r}, not a step_<n> of {root}"
        what, newest_step = f"{problem}: ignored", None
    else:
        problem = checkpoint_problem(newest)
        if problem is None:
            return newest, None
        what, newest_step = f"checkpoint {newest.name} is damaged ({problem})", step_number(newest)
    older = sorted(
        (p for p in root.glob("step_*")
         if (n := step_number(p)) is not None and (newest_step is None or n < newest_step)),
        key=step_number, reverse=True,
    )  # fmt: skip
    chosen = next((p for p in older if checkpoint_problem(p) is None), None)
    if chosen is None:
        log.warning("%s; no complete older step: starting from step 0", what)
        pointer.unlink()
    else:
        log.warning("%s; resuming from %s", what, chosen.name)
        _atomic_write_text(pointer, chosen.name)
    record = {
        "from_step": newest_step,
        "to_step": step_number(chosen) if chosen is not None else 0,
        "reason": problem,
    }
    return chosen, record


def pointed_step(root: Path) -> Path | None:
    """The step directory of ``root`` that ``latest`` names, or None: no pointer, or one
    that is not a ``step_<digits>`` of ``root`` (never followed out of this dir)."""
    try:
        text = (root / LATEST).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return root / text if STEP_DIR.fullmatch(text) else None


def resume_point(
    job_dir: Path | str, *, rank: int, group: dist.ProcessGroup | None = None
) -> tuple[Path | None, dict | None]:
    """The checkpoint every rank resumes from (None: start from step 0) and the fallback
    record (None when the newest step was complete). Collective: rank 0 removes stale
    ``.tmp_step_*`` directories, verifies (``choose_checkpoint``) and broadcasts its choice,
    so all ranks agree and no rank reads a file before rank 0 has looked at it."""
    root = checkpoint_root(job_dir)
    choice: list = [None, None]
    if rank == 0:
        remove_stale_saves(root)
        path, record = choose_checkpoint(root)
        choice = [path.name if path is not None else None, record]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(choice, src=0, group=group)
    name, record = choice
    return (root / name if name is not None else None), record
