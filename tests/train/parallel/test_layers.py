"""Each tensor-parallel layer against its plain single-process counterpart (4 gloo ranks).

Cases: a non-transposed TPLinear feeding a transposed one (the chain of an MLP), the
x-split LayerNorm, and the vocab-parallel embedding / tied head / cross-entropy with a
vocabulary that is not a multiple of x*y. The batch is split over z as in the model, so
weight gradients are summed over z by the layers themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.parallel.comm import Comm
from axonn_launch.train.parallel.gemm import GemmTuner
from axonn_launch.train.parallel.groups import build_groups, single_process_groups
from axonn_launch.train.parallel.layers import (
    OverlapRuntime,
    ShardLayout,
    TPLayerNorm,
    TPLinear,
    VocabParallelEmbedding,
)
from tests.train.dist_utils import run_world

GRIDS = [
    Grid(x=2, y=2),
    Grid(x=4),
    Grid(y=4),
    Grid(z=4),
    Grid(x=2, z=2),
    Grid(y=2, z=2),
    Grid(data=2, x=2),
]
OVERLAPS = [
    OverlapConfig(all_reduce=False, reduce_scatter=False, all_gather=False),
    OverlapConfig(all_reduce=True, reduce_scatter=True, all_gather=True),
    OverlapConfig(all_reduce=True, reduce_scatter=False, all_gather=False),
    OverlapConfig(all_reduce=False, reduce_scatter=True, all_gather=False),
    OverlapConfig(all_reduce=False, reduce_scatter=False, all_gather=True),
]
TOKENS, D_IN, D_MID, D_OUT = 8, 16, 24, 8


def _batch_chunk(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    return t.chunk(comm.size("z"))[comm.index("z")]


def _shard(t: torch.Tensor, layout: ShardLayout, comm: Comm) -> torch.Tensor:
    return layout.local_from_full(t, comm.groups)


def _full_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "x": (TOKENS, D_IN), "w1": (D_MID, D_IN), "b1": (D_MID,),
        "w2": (D_OUT, D_MID), "b2": (D_OUT,), "r": (TOKENS, D_OUT),
    }  # fmt: skip
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _reference_chain(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if k != "r"}
    hidden = F.gelu(F.linear(leaves["x"], leaves["w1"], leaves["b1"]))
    out = F.linear(hidden, leaves["w2"], leaves["b2"])
    (out * t["r"]).sum().backward()
    return {"out": out.detach(), **{f"d{k}": v.grad for k, v in leaves.items()}}


def _check_linear_chain(
    comm: Comm, overlap: OverlapConfig, label: str, tuner: GemmTuner | None = None
) -> None:
    runtime = OverlapRuntime(comm, overlap)
    runtime.tuner = tuner or runtime.tuner
    up = TPLinear(D_IN, D_MID, comm=comm, runtime=runtime, transpose=False, name="up")
    down = TPLinear(D_MID, D_OUT, comm=comm, runtime=runtime, transpose=True, name="down")
    runtime.set_plans(training=[up, down, down, up], inference=[up, down])
    full = _full_inputs()
    expected = _reference_chain(full)
    with torch.no_grad():
        for layer, w, b in ((up, "w1", "b1"), (down, "w2", "b2")):
            layer.weight.copy_(_shard(full[w], layer.weight.shard_layout, comm))
            layer.bias.copy_(_shard(full[b], layer.bias.shard_layout, comm))
    # input: batch over z, features over x (inner of the first layer), replicated over y
    x = _batch_chunk(full["x"], comm).chunk(comm.size("x"), dim=1)[comm.index("x")]
    x = x.clone().requires_grad_()
    runtime.begin_micro_step(training=True)
    out = down(F.gelu(up(x)))
    # output features are split over x (outer of the transposed layer)
    local = lambda t: _batch_chunk(t, comm).chunk(comm.size("x"), dim=1)[comm.index("x")]  # noqa: E731
    torch.testing.assert_close(out, local(expected["out"]), msg=lambda m: f"{label} out {m}")
    (out * local(full["r"])).sum().backward()
    runtime.flush_deferred_grads()
    torch.testing.assert_close(x.grad, local(expected["dx"]), msg=lambda m: f"{label} dx {m}")
    for layer, w, b in ((up, "dw1", "db1"), (down, "dw2", "db2")):
        torch.testing.assert_close(
            layer.weight.grad, _shard(expected[w], layer.weight.shard_layout, comm),
            msg=lambda m, n=layer.name: f"{label} {n} weight grad {m}",
        )  # fmt: skip
        bias_grad = layer.bias.grad.clone()
        comm.all_reduce(bias_grad, "z")  # biases are replicated over z: sum the batch shards
        torch.testing.assert_close(
            bias_grad, _shard(expected[b], layer.bias.shard_layout, comm),
            msg=lambda m, n=layer.name: f"{label} {n} bias grad {m}",
        )  # fmt: skip


def _check_layer_norm(comm: Comm, label: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(6, D_IN, generator=gen) * 3 + 1
    weight, bias = torch.randn(D_IN, generator=gen), torch.randn(D_IN, generator=gen)
    r = torch.randn(6, D_IN, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x_full, weight, bias)]
    expected = F.layer_norm(leaves[0], (D_IN,), leaves[1], leaves[2])
    (expected * r).sum().backward()
    norm = TPLayerNorm(D_IN, comm=comm, name="ln")
    cols = lambda t: t.chunk(comm.size("x"), dim=-1)[comm.index("x")]  # noqa: E731
    with torch.no_grad():
        norm.weight.copy_(cols(weight))
        norm.bias.copy_(cols(bias))
    x = cols(x_full).clone().requires_grad_()
    out = norm(x)
    torch.testing.assert_close(out, cols(expected.detach()), msg=lambda m: f"{label} ln {m}")
    (out * cols(r)).sum().backward()
    for got, want in ((x.grad, leaves[0].grad), (norm.weight.grad, leaves[1].grad),
                      (norm.bias.grad, leaves[2].grad)):  # fmt: skip
        torch.testing.assert_close(got, cols(want), msg=lambda m: f"{label} ln grad {m}")


def _check_embedding_and_loss(comm: Comm, label: str) -> None:
    vocab, seq, hidden, batch = 61, 5, 16, 4
    gen = torch.Generator().manual_seed(5)
    wte, wpe = torch.randn(vocab, hidden, generator=gen), torch.randn(seq, hidden, generator=gen)
    idx = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    mix = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
    ref_wte, ref_wpe = wte.clone().requires_grad_(), wpe.clone().requires_grad_()
    ref_hidden = ref_wte[idx] + ref_wpe
    ref_logits = (ref_hidden @ mix) @ ref_wte.t()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1))
    ref_loss.backward()

    emb = VocabParallelEmbedding(vocab, seq, hidden, comm=comm)
    with torch.no_grad():
        emb.wte.copy_(_shard(wte, emb.wte.shard_layout, comm))
        emb.wpe.copy_(_shard(wpe, emb.wpe.shard_layout, comm))
    cols = lambda t: t.chunk(comm.size("x"), dim=-1)[comm.index("x")]  # noqa: E731
    table = emb.token_table()
    local_idx, local_targets = _batch_chunk(idx, comm), _batch_chunk(targets, comm)
    hid = emb.embed(local_idx, table)
    torch.testing.assert_close(hid, cols(_batch_chunk(ref_hidden.detach(), comm)),
                               msg=lambda m: f"{label} embed {m}")  # fmt: skip
    # a stand-in for the blocks that mixes all hidden columns (gathered over x)
    gathered = torch.zeros(*hid.shape[:-1], hidden)
    gathered[..., cols(torch.arange(hidden))] = hid
    gathered = _sum_x(gathered, comm)
    loss = emb.loss(cols(gathered @ mix), table, local_targets)
    local_ref = F.cross_entropy(
        _batch_chunk(ref_logits.detach(), comm).reshape(-1, vocab), local_targets.reshape(-1)
    )
    torch.testing.assert_close(loss, local_ref, msg=lambda m: f"{label} loss {m}")
    (loss / comm.size("z")).backward()
    wpe_grad = emb.wpe.grad.clone()
    comm.all_reduce(wpe_grad, "z")
    torch.testing.assert_close(emb.wte.grad, _shard(ref_wte.grad, emb.wte.shard_layout, comm),
                               msg=lambda m: f"{label} wte grad {m}")  # fmt: skip
    torch.testing.assert_close(wpe_grad, _shard(ref_wpe.grad, emb.wpe.shard_layout, comm),
                               msg=lambda m: f"{label} wpe grad {m}")  # fmt: skip
    with torch.no_grad():
        last = emb.last_logits(cols(gathered @ mix), table)
    torch.testing.assert_close(last, _batch_chunk(ref_logits.detach(), comm)[:, -1],
                               msg=lambda m: f"{label} last logits {m}")  # fmt: skip


class _SumOverX(torch.autograd.Function):
    """Test helper: every x member contributes its columns; backward passes the sum's
    gradient to each member unchanged (each member uses its own columns only)."""

    @staticmethod
    def forward(ctx, t, comm):
        ctx.comm = comm
        out = t.clone()
        comm.all_reduce(out, "x")
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, "x")
        return grad, None


def _sum_x(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _SumOverX.apply(t, comm)


def _check_all(rank: int, world: int, fallback: bool) -> int:
    """All grids and overlaps; with the reduce-scatter fallback only grids with z > 1."""
    checked = 0
    grids = [g for g in GRIDS if g.z > 1] if fallback else GRIDS
    overlaps = OVERLAPS[:2] if fallback else OVERLAPS
    for grid in grids:
        comm = Comm(build_groups(grid, rank=rank), reduce_scatter_fallback=fallback)
        for overlap in overlaps:
            _check_linear_chain(comm, overlap, f"[{grid.describe()} {overlap} fb={fallback}]")
            checked += 1
        _check_layer_norm(comm, f"[{grid.describe()}]")
        _check_embedding_and_loss(comm, f"[{grid.describe()} fb={fallback}]")
    return checked


@pytest.mark.parametrize("fallback", [False, True], ids=["native-rs", "fallback-rs"])
def test_layers_equal_single_process(fallback):
    results = run_world(_check_all, 4, fallback, timeout=600)
    expected = 3 * 2 if fallback else len(GRIDS) * len(OVERLAPS)
    assert results == [expected] * 4


def test_single_process_chain_and_groups():
    comm = Comm(single_process_groups())
    for overlap in OVERLAPS:
        _check_linear_chain(comm, overlap, "[single]")
    _check_layer_norm(comm, "[single]")
    _check_embedding_and_loss(comm, "[single]")


def test_linear_gemms_go_through_the_models_tuner():
    """The three GEMMs of each Linear are the tuner's ``fwd``, ``dx`` and ``dw``, with
    the shapes of X W^T, dY W and dY^T X; the chain's results stay those of one process."""
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)  # tunes every GEMM, however small
    _check_linear_chain(Comm(single_process_groups()), OVERLAPS[1], "[tuned]", tuner)
    tuned = {tuple(key.split()[i] for i in (0, 1, 5)) for key in tuner.choices()}
    expected = set()
    for d_in, d_out in ((D_IN, D_MID), (D_MID, D_OUT)):
        expected |= {("fwd", f"{TOKENS}x{d_in}", f"{d_in}x{d_out}"),
                     ("dx", f"{TOKENS}x{d_out}", f"{d_out}x{d_in}"),
                     ("dw", f"{d_out}x{TOKENS}", f"{TOKENS}x{d_in}")}  # fmt: skip
    assert tuned == expected


def test_gpt_tuner_follows_gemm_tuning():
    spec = ModelSpec("tiny", n_layer=1, d_model=16, n_head=2, vocab_size=32, max_seq_len=8)
    for enabled in (False, True):
        model = GPT(spec, groups=single_process_groups(), overlap=OVERLAPS[0],
                    gemm_tuning=enabled)  # fmt: skip
        assert model.runtime.tuner.enabled is enabled


def _group_members(rank: int, grid: Grid) -> dict:
    import torch.distributed as dist

    groups = build_groups(grid, rank=rank)
    members = {}
    for axis in ("x", "y", "z", "z_gather", "data", "plane"):
        group = groups.group(axis)
        if group is None:
            members[axis] = None
            continue
        ranks = [0] * dist.get_world_size(group)
        dist.all_gather_object(ranks, rank, group=group)
        members[axis] = ranks
    members["separate_z_gather"] = groups.z_gather is not None and groups.z_gather is not groups.z
    return members


def _groups_match_grid(rank: int, world: int, grids: list[Grid]) -> list[dict]:
    return [_group_members(rank, grid) for grid in grids]


def test_build_groups_follow_the_grid_layout():
    grids = [Grid(x=2, y=2), Grid(y=2, z=2), Grid(data=2, x=2)]
    for rank, per_grid in enumerate(run_world(_groups_match_grid, 4, grids)):
        for grid, members in zip(grids, per_grid):
            for axis in ("x", "y", "z", "data"):
                expected = next(g for g in grid.groups(axis) if rank in g)
                assert members[axis] == (expected if len(expected) > 1 else None), (grid, axis)
            plane = next(g for g in grid.plane_groups() if rank in g)
            assert members["plane"] == (plane if len(plane) > 1 else None), grid
            assert members["z_gather"] == members["z"], grid
            assert members["separate_z_gather"] == (grid.z > 1), grid
