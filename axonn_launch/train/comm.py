"""Every collective the parallel model issues, with optional recording.

A ``Comm`` wraps the grid's ``Groups``. Collectives are addressed by axis name
("x", "y", "z", "data", "plane"); over a group of size one they are skipped (and not
recorded). A ``Recorder`` attached to a ``Comm`` (``with comm.recording() as rec``)
logs each collective as (op, axis, group size, elements, dtype, tag) so tests can
count them. For all-gather and reduce-scatter the recorded size is the gathered
(full) size, the convention of the AxoNN volume table.

Gloo gained ``reduce_scatter_tensor`` only in recent torch releases. Where it is
missing (or when ``reduce_scatter_fallback=True``) a reduce-scatter runs as an
all-reduce of the full tensor followed by taking this rank's slice. The data moved
is twice that of a true reduce-scatter, but the result is identical and the record
still says ``reduce_scatter``, the operation the algorithm asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from axonn_launch.train.groups import Groups

_GLOO_NATIVE_REDUCE_SCATTER = (2, 6)  # torch release from which gloo is assumed to have it

# Newer torch names the single-tensor collectives *_single and deprecates the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    op: str  # all_reduce | all_reduce_max | all_gather | reduce_scatter
    axis: str
    group_size: int
    numel: int  # all-reduce: tensor size; all-gather / reduce-scatter: gathered size
    dtype: torch.dtype
    tag: str = ""


@dataclass
class Recorder:
    records: list[CommRecord] = field(default_factory=list)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)

    def select(
        self, op: str | None = None, axis: str | None = None, tag: str | None = None
    ) -> list[CommRecord]:
        """Records matching ``op``, ``axis`` and a tag starting with ``tag``."""
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (axis is None or r.axis == axis)
            and (tag is None or r.tag.startswith(tag))
        ]

    def total(self, op: str | None = None, axis: str | None = None, tag: str | None = None) -> int:
        return sum(r.numel for r in self.select(op, axis, tag))

    def clear(self) -> None:
        self.records.clear()


class Handle:
    """A collective in flight; ``wait()`` completes it and any copy-out it needs."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def _done() -> Handle:
    return Handle()


class Comm:
    def __init__(
        self,
        groups: Groups,
        *,
        recorder: Recorder | None = None,
        reduce_scatter_fallback: bool | None = None,
    ) -> None:
        self.groups = groups
        self.recorder = recorder
        self._rs_fallback = reduce_scatter_fallback

    @contextmanager
    def recording(self, recorder: Recorder | None = None) -> Iterator[Recorder]:
        previous = self.recorder
        self.recorder = recorder if recorder is not None else Recorder()
        try:
            yield self.recorder
        finally:
            self.recorder = previous

    def size(self, axis: str) -> int:
        return self.groups.size(axis)

    def index(self, axis: str) -> int:
        return self.groups.index(axis)

    def _record(self, op: str, axis: str, numel: int, dtype: torch.dtype, tag: str) -> None:
        if self.recorder is not None:
            self.recorder.add(CommRecord(op, axis, self.size(axis), numel, dtype, tag))

    def all_reduce(
        self,
        tensor: torch.Tensor,
        axis: str,
        *,
        tag: str = "",
        async_op: bool = False,
        op: str = "sum",
    ) -> Handle:
        """In-place sum (or ``op="max"``) over ``axis``."""
        if self.size(axis) == 1:
            return _done()
        self._record("all_reduce" if op == "sum" else f"all_reduce_{op}", axis, tensor.numel(),
                     tensor.dtype, tag)  # fmt: skip
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(
            tensor, op=reduce_op, group=self.groups.group(axis), async_op=async_op
        )
        return Handle(work)

    def all_gather(
        self,
        shard: torch.Tensor,
        axis: str,
        *,
        tag: str = "",
        async_op: bool = False,
        group_name: str | None = None,
    ) -> tuple[torch.Tensor, Handle]:
        """Concatenate every member's ``shard`` along dim 0, in group order.

        ``group_name`` picks another communicator with the same members as ``axis``
        (``"z_gather"``); the record still names ``axis``.
        """
        p = self.size(axis)
        if p == 1:
            return shard, _done()
        shard = shard.contiguous()
        out = shard.new_empty((p * shard.shape[0], *shard.shape[1:]))
        self._record("all_gather", axis, out.numel(), shard.dtype, tag)
        group = self.groups.group(group_name or axis)
        work = _all_gather_single(out, shard, group=group, async_op=async_op)
        return out, Handle(work)

    def reduce_scatter(
        self, full: torch.Tensor, axis: str, *, tag: str = "", async_op: bool = False
    ) -> tuple[torch.Tensor, Handle]:
        """Sum ``full`` over ``axis`` and keep this rank's dim-0 chunk.

        ``full`` may be overwritten (the fallback reduces it in place).
        """
        p = self.size(axis)
        if p == 1:
            return full, _done()
        full = full.contiguous()
        self._record("reduce_scatter", axis, full.numel(), full.dtype, tag)
        group = self.groups.group(axis)
        out = full.new_empty((full.shape[0] // p, *full.shape[1:]))
        if not self._use_rs_fallback(group):
            work = _reduce_scatter_single(out, full, group=group, async_op=async_op)
            return out, Handle(work)
        work = dist.all_reduce(full, group=group, async_op=async_op)
        chunk = full.chunk(p, dim=0)[self.index(axis)]
        handle = Handle(work, finish=lambda: out.copy_(chunk))
        if not async_op:
            handle.wait()
        return out, handle

    def _use_rs_fallback(self, group: dist.ProcessGroup) -> bool:
        if self._rs_fallback is not None:
            return self._rs_fallback
        if dist.get_backend(group) != "gloo":
            return False
        version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        return version < _GLOO_NATIVE_REDUCE_SCATTER
