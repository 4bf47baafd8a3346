"""Every collective the parallel model issues, with optional recording.

A ``Comm`` wraps the grid's ``Groups``: collectives are addressed by axis name and
skipped over a group of size one. A ``Recorder`` logs each collective so tests can count
them. ``resolve_wire`` is the one place where the wire dtypes' "auto" is decided. A
``WaitClock`` adds up the time this rank spends blocked in collectives (every call and
every wait on a handle), which the straggler measure subtracts from the step
(``train/health/monitor.py``).

Record conventions, wire dtypes and gloo's reduce-scatter fallback: ``docs/job-side.md``
("train/parallel/comm.py").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from axonn_launch.common.spec import WireConfig
from axonn_launch.train.parallel.groups import Groups

_GLOO_NATIVE_REDUCE_SCATTER = (2, 6)  # torch release from which gloo is assumed to have it

# Newer torch names the single-tensor collectives *_single and deprecates the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_WIRE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Wire:
    """The dtype in which each tensor-parallel collective travels.

    ``all_gather``: weight blocks gathered over z (every ``TPLinear`` and the token
    table); ``reduce_scatter``: their gradients reduce-scattered over z;
    ``all_reduce``: the input-gradient (dX) all-reduces of the ``TPLinear``s over x and
    y. Nothing else is affected: forward activations travel in the dtype the compute
    produced, LayerNorm statistics and losses in fp32, and the z and data gradient
    all-reduces of ``finish_gradients`` in the fp32 of ``param.grad``.
    """

    all_gather: torch.dtype = torch.float32
    reduce_scatter: torch.dtype = torch.float32
    all_reduce: torch.dtype = torch.float32


FP32_WIRE = Wire()


def resolve_wire(config: WireConfig, compute: torch.dtype) -> Wire:
    """``auto`` is bf16 when the job computes in bf16 (autocast) and fp32 otherwise
    (``WireConfig.resolved``, the rule the planner uses too)."""
    names = config.resolved(compute == torch.bfloat16)
    return Wire(
        all_gather=_WIRE_NAMES[names.all_gather],
        reduce_scatter=_WIRE_NAMES[names.reduce_scatter],
        all_reduce=_WIRE_NAMES[names.all_reduce],
    )


@dataclass(frozen=True)
class CommRecord:
    op: str  # all_reduce | all_reduce_max | all_gather | reduce_scatter
    axis: str
    group_size: int
    numel: int  # all-reduce: tensor size; all-gather / reduce-scatter: gathered size
    dtype: torch.dtype
    tag: str = ""

    @property
    def bytes(self) -> int:
        """Size in bytes of the dtype that travelled (gathered size for AG / RS)."""
        return self.numel * self.dtype.itemsize


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

    def total_bytes(
        self, op: str | None = None, axis: str | None = None, tag: str | None = None
    ) -> int:
        return sum(r.bytes for r in self.select(op, axis, tag))

    def clear(self) -> None:
        self.records.clear()


class WaitClock:
    """The seconds this rank spent blocked in collectives since the last ``take``.

    On a CPU a span is the host's wall time inside the call (gloo blocks the caller until
    the collective is done, or until ``wait()`` returns for an asynchronous one). On a GPU
    a span is read from two CUDA events recorded on the current stream around the call:
    NCCL/RCCL return at once and make that stream wait, so the events' distance is the
    time the stream, not the host, was held up (read later, from ``cut``'s ``Waited``: no
    synchronization in the step).
    """

    def __init__(self) -> None:
        self.seconds = 0.0  # host spans since the last cut
        self.events: list = []  # (start, end) CUDA event pairs

    @contextmanager
    def span(self, tensor: torch.Tensor | None = None) -> Iterator[None]:
        if tensor is not None and tensor.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((start, end))
            return
        began = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - began

    def cut(self) -> Waited:
        """The blocked time since the last ``cut``, to be read once its events are done."""
        waited = Waited(self.seconds, self.events)
        self.seconds, self.events = 0.0, []
        return waited


@dataclass(frozen=True)
class Waited:
    """Blocked time: host seconds and CUDA event pairs (read by ``seconds()`` once the
    stream has passed them, e.g. after the step-boundary all-reduce's result is read)."""

    host: float = 0.0
    events: list = field(default_factory=list)

    def seconds(self) -> float:
        return self.host + sum(start.elapsed_time(end) for start, end in self.events) / 1000


class Handle:
    """A collective in flight; ``wait()`` completes it and any copy-out it needs, on
    ``clock`` (the time blocked in it)."""

    def __init__(
        self,
        work=None,
        finish: Callable[[], None] | None = None,
        *,
        clock: WaitClock | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        self._work = work
        self._finish = finish
        self._clock, self._tensor = clock, tensor

    def wait(self) -> None:
        if self._work is not None:
            if self._clock is None:
                self._work.wait()
            else:
                with self._clock.span(self._tensor):
                    self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def _done() -> Handle:
    return Handle()


def _on_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor as it is sent: cast to ``dtype`` (a copy) when that differs."""
    return tensor if dtype is None else tensor.to(dtype)


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
        self.waits = WaitClock()

    def _issue(
        self,
        launch: Callable[[], object],
        tensor: torch.Tensor,
        async_op: bool,
        finish: Callable[[], None] | None = None,
    ) -> Handle:
        """Start a collective: a synchronous one is timed as blocked here, an asynchronous
        one when its handle is waited on."""
        if async_op:
            return Handle(launch(), finish, clock=self.waits, tensor=tensor)
        with self.waits.span(tensor):
            work = launch()
        return Handle(work, finish)

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
        group = self.groups.group(axis)
        return self._issue(
            lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op),
            tensor,
            async_op,
        )

    def all_reduce_in(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, *, axis: str, tag: str = ""
    ) -> None:
        """In-place sum over ``group``, a group that is not one of the grid's axes (Llama's
        KV replicas over y), recorded under the name ``axis``."""
        size = 1 if group is None else dist.get_world_size(group)
        if size == 1:
            return
        if self.recorder is not None:
            self.recorder.add(CommRecord("all_reduce", axis, size, tensor.numel(), tensor.dtype,
                                         tag))  # fmt: skip
        with self.waits.span(tensor):
            dist.all_reduce(tensor, group=group)

    def all_reduce_as(
        self, tensor: torch.Tensor, axis: str, dtype: torch.dtype, *, tag: str = "",
        async_op: bool = False,
    ) -> tuple[torch.Tensor, Handle]:  # fmt: skip
        """Sum over ``axis`` sent in ``dtype``; returns the sum (in ``dtype``).

        ``tensor`` itself is summed in place when it already has ``dtype``; otherwise a
        cast copy is. Over a group of one, ``tensor`` comes back unchanged.
        """
        if self.size(axis) == 1:
            return tensor, _done()
        sent = _on_wire(tensor, dtype)
        return sent, self.all_reduce(sent, axis, tag=tag, async_op=async_op)

    def all_gather(
        self,
        shard: torch.Tensor,
        axis: str,
        *,
        tag: str = "",
        async_op: bool = False,
        group_name: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, Handle]:
        """Concatenate every member's ``shard`` along dim 0, in group order.

        ``group_name`` picks another communicator with the same members as ``axis``
        (``"z_gather"``); the record still names ``axis``. With ``dtype`` the shard is
        sent, and the result returned, in that dtype.
        """
        p = self.size(axis)
        if p == 1:
            return shard, _done()
        shard = _on_wire(shard, dtype).contiguous()
        out = shard.new_empty((p * shard.shape[0], *shard.shape[1:]))
        self._record("all_gather", axis, out.numel(), shard.dtype, tag)
        group = self.groups.group(group_name or axis)
        launch = lambda: _all_gather_single(out, shard, group=group, async_op=async_op)  # noqa: E731
        return out, self._issue(launch, out, async_op)

    def reduce_scatter(
        self,
        full: torch.Tensor,
        axis: str,
        *,
        tag: str = "",
        async_op: bool = False,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, Handle]:
        """Sum ``full`` over ``axis`` and keep this rank's dim-0 chunk.

        ``full`` may be overwritten (the fallback reduces it in place). With ``dtype``
        it is sent, and the chunk returned, in that dtype.
        """
        p = self.size(axis)
        if p == 1:
            return full, _done()
        full = _on_wire(full, dtype).contiguous()
        self._record("reduce_scatter", axis, full.numel(), full.dtype, tag)
        group = self.groups.group(axis)
        out = full.new_empty((full.shape[0] // p, *full.shape[1:]))
        if not self._use_rs_fallback(group):
            launch = lambda: _reduce_scatter_single(out, full, group=group, async_op=async_op)  # noqa: E731
            return out, self._issue(launch, out, async_op)
        chunk = full.chunk(p, dim=0)[self.index(axis)]
        launch = lambda: dist.all_reduce(full, group=group, async_op=async_op)  # noqa: E731
        handle = self._issue(launch, full, async_op, finish=lambda: out.copy_(chunk))
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
