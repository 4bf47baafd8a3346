"""TPLayerNorm over x = 2 and x = 4 is exact at large mean offsets (4 gloo ranks).

The input of every token is ``offset + scale * N(0, 1)`` in fp32; the reference is
``F.layer_norm`` in float64 on the same fp32 values (and the same weight, bias and
output gradient), i.e. the exact LayerNorm of those values. fp32's ``F.layer_norm`` is
not such a reference: at offset 1e4 the fp32 mean alone is off by up to half an ulp of
1e4 (5e-4), which the output inherits divided by the scale; the test checks that this
is so, so that the 1e-5 bound below really separates exact from one-pass statistics.

Bounds, all relative to the scale of the quantity: output (normalized, times a weight
of order one) 1e-5; input gradient 1e-5 of its largest entry; weight and bias
gradients 1e-5 of theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axonn_launch.common.grid import Grid
from axonn_launch.train.parallel.comm import Comm, Recorder
from axonn_launch.train.parallel.groups import build_groups
from axonn_launch.train.parallel.layers import TPLayerNorm
from tests.train.dist_utils import run_world

OFFSETS = (0.0, 1e3, 1e4)
SCALES = (1.0, 0.25)
GRIDS = [Grid(x=2, y=2), Grid(x=4)]
TOKENS, HIDDEN = 48, 64
BOUND = 1e-5


def _case(offset: float, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(offset) + int(100 * scale))
    x = (offset + scale * torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)).float()
    return {
        "x": x,
        "weight": (1 + 0.5 * torch.randn(HIDDEN, generator=gen)).float(),
        "bias": torch.randn(HIDDEN, generator=gen).float(),
        "dy": torch.randn(TOKENS, HIDDEN, generator=gen).float(),
    }


def _reference(case: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``F.layer_norm`` in ``dtype``: output and the gradients of sum(out * dy)."""
    leaves = {k: case[k].detach().to(dtype).requires_grad_() for k in ("x", "weight", "bias")}
    out = F.layer_norm(leaves["x"], (HIDDEN,), leaves["weight"], leaves["bias"], eps=1e-5)
    (out * case["dy"].to(dtype)).sum().backward()
    return {"out": out.detach(), **{f"d{k}": v.grad for k, v in leaves.items()}}


def _worst_errors(got: dict, want: dict) -> dict[str, float]:
    """Max abs error of each quantity relative to its scale (the output's is 1)."""
    scale = {"out": 1.0, **{k: float(want[k].abs().max()) for k in ("dx", "dweight", "dbias")}}
    return {k: float((got[k].double() - want[k].double()).abs().max()) / scale[k] for k in scale}


def _parallel(case: dict[str, torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
    """TPLayerNorm on this rank's x slice; results gathered back to full width."""
    parts, me = comm.size("x"), comm.index("x")

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(parts, dim=-1)[me]

    norm = TPLayerNorm(HIDDEN, comm=comm, name="ln")
    with torch.no_grad():
        norm.weight.copy_(cols(case["weight"]))
        norm.bias.copy_(cols(case["bias"]))
    x = cols(case["x"]).clone().requires_grad_()
    out = norm(x)
    (out * cols(case["dy"])).sum().backward()
    local = {"out": out.detach(), "dx": x.grad, "dweight": norm.weight.grad,
             "dbias": norm.bias.grad}  # fmt: skip
    return {k: _gather_columns(v, comm) for k, v in local.items()}


def _gather_columns(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    gathered, _ = comm.all_gather(t.movedim(-1, 0).contiguous(), "x")
    return gathered.movedim(0, -1)


def _errors_on_every_grid(rank: int, world: int) -> list[tuple]:
    rows = []
    for grid in GRIDS:
        comm = Comm(build_groups(grid, rank=rank))
        for offset in OFFSETS:
            for scale in SCALES:
                case = _case(offset, scale)
                with comm.recording() as rec:
                    got = _parallel(case, comm)
                errors = _worst_errors(got, _reference(case, torch.float64))
                rows.append((grid.x, offset, scale, errors, _ln_collectives(rec)))
    return rows


def _ln_collectives(rec: Recorder) -> list[tuple[str, str, int]]:
    return [(r.op, r.axis, r.numel) for r in rec.select(tag="ln")]


def test_layer_norm_over_x_is_exact_at_large_offsets():
    results = run_world(_errors_on_every_grid, 4, timeout=300)
    assert all(r == results[0] for r in results), "ranks disagree on the statistics"
    assert len(results[0]) == len(GRIDS) * len(OFFSETS) * len(SCALES)
    for x, offset, scale, errors, collectives in results[0]:
        label = f"x={x} offset={offset:g} scale={scale:g}"
        for quantity, error in errors.items():
            assert error <= BOUND, f"{label}: {quantity} error {error:.2e} > {BOUND:g}"
        # one collective each way: the statistics all-gather (shift, correction, M2 per
        # token and member) and the backward all-reduce of (sum g, sum g*x_hat)
        assert collectives == [("all_gather", "x", 3 * TOKENS * x),
                               ("all_reduce", "x", 2 * TOKENS)], label  # fmt: skip


def test_fp32_reference_would_not_meet_the_bound():
    """The bound is tight enough to tell: fp32 ``F.layer_norm`` (and the one-pass
    E[x^2] - mean^2 the layer used before) miss it at offset 1e4."""
    case = _case(1e4, 1.0)
    exact = _reference(case, torch.float64)
    fp32 = _reference(case, torch.float32)
    assert _worst_errors(fp32, exact)["out"] > 10 * BOUND
    x = case["x"]
    mean = x.mean(-1, keepdim=True)
    var = ((x * x).mean(-1, keepdim=True) - mean * mean).clamp_min(0.0)
    one_pass = (x - mean) * torch.rsqrt(var + 1e-5)
    plain = F.layer_norm(x.double(), (HIDDEN,), eps=1e-5)
    assert float((one_pass.double() - plain).abs().max()) > 10 * BOUND
