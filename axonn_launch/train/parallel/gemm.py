"""GEMM layout tuning: a per-shape matmul tuner after AxoNN's (axonn.md §3.2).

A BLAS library picks its kernel by the operands' transpose combination, and one
combination can be much slower than another for the same product. ``GemmTuner`` times
the equivalent ``FORMULATIONS`` of each distinct GEMM signature on its first call and uses
the fastest from then on, within a bounded cost.

Why, what it costs and how autocast is kept: ``docs/job-side.md``
("train/parallel/gemm.py").
"""

from __future__ import annotations

import functools
import logging
import statistics
from dataclasses import dataclass

import torch

from axonn_launch.train.parallel.timing import per_call_seconds

log = logging.getLogger(__name__)

MIN_FLOPS = 2**20
STORAGES = ("given", "row", "col")


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """As ``is_contiguous`` for a matrix: strides of size-1 dimensions do not count."""
    (rows, cols), (row_stride, col_stride) = shape, stride
    return (cols == 1 or col_stride == 1) and (rows == 1 or row_stride == cols)


def storage_of(shape: tuple[int, ...], stride: tuple[int, ...]) -> str:
    """``row`` (row-major), ``col`` (column-major) or ``strided``."""
    if _row_major(shape, stride):
        return "row"
    return "col" if _row_major(shape[::-1], stride[::-1]) else "strided"


def layout(t: torch.Tensor) -> str:
    """Storage of a matrix: ``row`` (row-major), ``col`` (column-major) or ``strided``."""
    return storage_of(tuple(t.shape), t.stride())


def stored(t: torch.Tensor, storage: str) -> torch.Tensor:
    """``t`` as given, or copied (if not already so) into row- or column-major storage."""
    if storage == "row":
        return t.contiguous()
    if storage == "col":
        return t.t().contiguous().t()
    return t


def _autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def autocast_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands as autocast would cast them for ``a @ b`` (unchanged without it)."""
    kind = a.device.type
    if not torch.is_autocast_enabled(kind):
        return a, b
    dtype = torch.get_autocast_dtype(kind)
    return _autocast_cast(a, dtype), _autocast_cast(b, dtype)


@dataclass(frozen=True)
class Formulation:
    """One way to compute ``a @ b``: the direct product ``a @ b`` or the transposed one
    ``(bᵀ @ aᵀ)ᵀ``, with that product's left and right operands kept as given or stored
    row- or column-major first."""

    name: str
    transposed: bool
    lhs: str  # storage of the product's left operand: a (direct) or bᵀ (transposed)
    rhs: str  # ... and of its right one: b or aᵀ

    def operands(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (b.t(), a.t()) if self.transposed else (a, b)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        left, right = self.operands(*autocast_operands(a, b))
        product = stored(left, self.lhs) @ stored(right, self.rhs)
        return product.t().contiguous() if self.transposed else product

    def kernel(self, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str, str]:
        """What decides the work done: formulations with equal keys run the same copies
        and the same GEMM kernel on these operands."""
        left, right = self.operands(a, b)
        return (
            self.transposed,
            layout(left) if self.lhs == "given" else self.lhs,
            layout(right) if self.rhs == "given" else self.rhs,
        )


def _formulation(transposed: bool, lhs: str, rhs: str) -> Formulation:
    variant = {("given", "given"): "", ("row", "row"): "_contiguous"}.get((lhs, rhs))
    if variant is None:
        variant = "_lhs_col" if lhs == "col" else "_rhs_col"
    name = ("transposed" if transposed else "direct") + variant
    return Formulation(name, transposed, lhs, rhs)


# AxoNN's eight: as given, both contiguous, left column-major, right column-major; for
# the direct and the transposed problem. For a weight operand (fwd: b = Wᵀ, dx: b = W)
# the column-major copy is its transposed-storage variant.
FORMULATIONS: dict[str, Formulation] = {
    f.name: f
    for f in (
        _formulation(transposed, lhs, rhs)
        for transposed in (False, True)
        for lhs, rhs in (("given", "given"), ("row", "row"), ("col", "given"), ("given", "col"))
    )
}
DIRECT = FORMULATIONS["direct"]


def distinct_formulations(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """Names of the formulations that do different work on these operands (the first
    of each group of equivalents, in ``FORMULATIONS`` order, so ``direct`` is always in)."""
    seen: set[tuple[bool, str, str]] = set()
    names = []
    for name, formulation in FORMULATIONS.items():
        key = formulation.kernel(a, b)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


def _seconds_per_call(fn, a: torch.Tensor, b: torch.Tensor, warmup: int, reps: int) -> float:
    """Median seconds of one call after ``warmup`` calls; CUDA events on GPU."""
    call = functools.partial(fn, a, b)
    return statistics.median(per_call_seconds(call, a.device, reps, warmup=warmup))


def time_formulations(
    a: torch.Tensor,
    b: torch.Tensor,
    reps: int = 5,
    *,
    warmup: int = 2,
    names: list[str] | None = None,
) -> dict[str, float]:
    """Seconds per call (median of ``reps`` after ``warmup``) of each formulation of
    ``a @ b`` named (default: all of ``FORMULATIONS``), under the caller's autocast."""
    if reps < 1:
        raise ValueError(f"reps={reps}: need at least one timed call")
    with torch.no_grad():
        return {
            name: _seconds_per_call(FORMULATIONS[name], a, b, warmup, reps)
            for name in (names or list(FORMULATIONS))
        }


Signature = tuple


def signature(op: str, a: torch.Tensor, b: torch.Tensor) -> Signature:
    """What a pick depends on; strides stand for the layouts (cheaper, on every call)."""
    kind = a.device.type
    amp = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return (op, a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, kind, amp)


def describe(sig: Signature) -> str:
    """``fwd 256x64 row float32 @ 64x192 col float32 cpu autocast bfloat16``"""
    op, a_shape, a_stride, a_dtype, b_shape, b_stride, b_dtype, kind, amp = sig

    def operand(shape, stride, dtype) -> str:
        storage = storage_of(tuple(shape), stride)
        return f"{'x'.join(map(str, shape))} {storage} {str(dtype).removeprefix('torch.')}"

    text = f"{op} {operand(a_shape, a_stride, a_dtype)} @ {operand(b_shape, b_stride, b_dtype)}"
    text += f" {kind}"
    return text + (f" autocast {str(amp).removeprefix('torch.')}" if amp is not None else "")


class GemmTuner:
    """``mm(op, a, b)`` computes ``a @ b`` with the fastest formulation for its signature,
    timed on the signature's first call (see the module docstring). ``enabled=False``:
    always plain ``a @ b``, nothing timed. Matrices only; anything else is ``a @ b``."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        warmup: int = 1,
        reps: int = 3,
        min_flops: float = MIN_FLOPS,
        max_signatures: int = 64,
    ) -> None:
        self.enabled = enabled
        self.warmup, self.reps = warmup, reps
        self.min_flops, self.max_signatures = min_flops, max_signatures
        self._picks: dict[Signature, Formulation] = {}  # every signature seen
        self._tuned: dict[Signature, str] = {}  # those that were timed
        self._new: dict[str, str] = {}  # tuned picks not yet taken by take_new()
        self.tunings = 0  # signatures timed
        self.timed_calls = 0  # formulation calls made for timing (warm-ups included)
        self._said: set[str] = set()

    def mm(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for the GEMM called ``op`` (``fwd``, ``dx`` or ``dw``)."""
        if not self.enabled or a.dim() != 2 or b.dim() != 2:
            return a @ b
        key = signature(op, a, b)
        pick = self._picks.get(key)
        if pick is None:
            pick = self._picks[key] = self._choose(key, a, b)
        return a @ b if pick is DIRECT else pick(a, b)

    def _choose(self, key: Signature, a: torch.Tensor, b: torch.Tensor) -> Formulation:
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if flops < self.min_flops:
            self._say_once(logging.DEBUG, "small", "GEMMs under %.3g MFLOP run as given,"
                           " untuned (first: %s)", self.min_flops / 1e6, describe(key))  # fmt: skip
            return DIRECT
        if len(self._tuned) >= self.max_signatures:
            self._say_once(logging.INFO, "budget", "GEMM tuning budget of %d signatures spent;"
                           " %s and later new ones run as given", self.max_signatures,
                           describe(key))  # fmt: skip
            return DIRECT
        names = distinct_formulations(a, b)
        seconds = time_formulations(a, b, self.reps, warmup=self.warmup, names=names)
        self.tunings += 1
        self.timed_calls += (self.warmup + self.reps) * len(names)
        best = min(seconds, key=seconds.__getitem__)
        self._tuned[key] = self._new[describe(key)] = best
        log.debug("gemm %s (%.3g MFLOP): picked %s; ms per call: %s", describe(key), flops / 1e6,
                 best, ", ".join(f"{n} {s * 1e3:.3g}" for n, s in seconds.items()))  # fmt: skip
        return FORMULATIONS[best]

    def _say_once(self, level: int, what: str, message: str, *args: object) -> None:
        if what not in self._said:
            self._said.add(what)
            log.log(level, message, *args)

    def choices(self) -> dict[str, str]:
        """Signature (``describe``) -> chosen formulation, for every tuned signature."""
        return {describe(key): name for key, name in self._tuned.items()}

    def take_new(self) -> dict[str, str]:
        """The picks made since the last call (for the metrics), then forgets them."""
        new, self._new = self._new, {}
        return new

    @property
    def has_new(self) -> bool:
        return bool(self._new)
