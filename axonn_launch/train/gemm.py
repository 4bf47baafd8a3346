"""GEMM layout tuning (AxoNN's per-shape matmul tuner, axonn.md §3.2).

STUB: the interface the layers call. ``GemmTuner.mm(op, a, b)`` returns ``a @ b``;
the tuner is to time equivalent formulations per (op, shapes, layouts, dtype) during
the first calls and keep the fastest.
"""

from __future__ import annotations

import torch


class GemmTuner:
    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled

    def mm(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for the GEMM called ``op`` (``fwd``, ``dx`` or ``dw``)."""
        return a @ b

    def choices(self) -> dict[str, str]:
        """Signature -> chosen formulation, for the job log and metrics."""
        return {}
