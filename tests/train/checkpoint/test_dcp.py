"""DCP checkpoints: shard boxes, save on grid A and resume on grid B, stock readers.

Worlds of real gloo processes train a small GPT (odd vocab, so the token table has
padded rows) for two steps on grid A, save asynchronously, and train two more steps.
Other worlds build the model on grid B, load the checkpoint and train the same two
steps: the loaded shards equal the saved full state cut for B bit for bit, and the
losses continue as A's uninterrupted run did (rel 1e-5; only the reduction order
differs between grids).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.checkpoint.manager import Checkpointer, latest_checkpoint, read_meta
from axonn_launch.train.checkpoint.state import (
    MOMENTS,
    load_training_state,
    moment_key,
    save_training_state,
    step_key,
)
from axonn_launch.train.models.adamw import AdamW
from axonn_launch.train.models.gpt import (
    GPT,
    _gather_full,
    clip_grad_norm_,
    finish_gradients,
    full_state_dict,
)
from axonn_launch.train.parallel.groups import build_groups
from axonn_launch.train.parallel.shards import (
    ShardSavePlanner,
    band_split,
    grid_position,
    piece_view,
    shard_pieces,
)
from tests.train.dist_utils import run_world

SPEC = ModelSpec("t", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
BATCH, SEQ, LR = 8, 16, 1e-2
SAVE_AT, MORE = 2, 2

# (grid A, grid B): x, y, z, data and rank-count changes
PAIRS = [
    (Grid(x=2, z=2), Grid(data=2, z=2)),
    (Grid(x=2, y=2), Grid(z=4)),
    (Grid(y=2, z=2), Grid(x=4)),
    (Grid(data=2, z=2), Grid(x=2, y=2)),
    (Grid(x=2, z=2), Grid(z=2)),
    (Grid(z=2), Grid(x=2, y=2)),
    (Grid(x=2, y=2), Grid()),
]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _local(t: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
    c = grid.coords(rank)
    return t.chunk(grid.data * grid.z)[c.data * grid.z + c.z]


def _train(model: GPT, optimizer, steps: range) -> list[float]:
    groups, grid = model.groups, model.groups.grid
    losses = []
    for step in steps:
        idx, targets = _batch(step)
        loss = model(_local(idx, grid, groups.rank), _local(targets, grid, groups.rank))
        loss.backward()
        finish_gradients(model, groups)
        clip_grad_norm_(model, 1.0, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        model.comm.all_reduce(total, "z")
        model.comm.all_reduce(total, "data")
        losses.append(float(total) / (grid.z * grid.data))
    return losses


def _build(grid: Grid, rank: int):
    groups = build_groups(grid, rank=rank)
    model = GPT(SPEC, groups=groups, overlap=OverlapConfig(), seed=3)
    optimizer = AdamW([{"params": model.parameters()}], lr=LR, weight_decay=0.1)
    return model, optimizer, groups


def _full_state(model: GPT, optimizer) -> dict[str, torch.Tensor]:
    """Parameters and moments as full tensors (test-only: gathers everything)."""
    full = full_state_dict(model, model.groups)
    for name, param in model.named_parameters():
        for moment in MOMENTS:
            local = optimizer.state[param][moment]
            full[moment_key(name, moment)] = _gather_full(model, model.groups, name, local)
    return full


def _save_worlds(rank: int, world: int, grids: list[Grid], root: str) -> dict:
    out = {}
    group = dist.new_group(backend="gloo")
    for grid in grids:
        model, optimizer, groups = _build(grid, rank)
        before = _train(model, optimizer, range(SAVE_AT))
        job = f"{root}/{grid.describe()}"
        checkpointer = Checkpointer(job, rank=rank, keep=2, group=group)
        save_training_state(
            checkpointer, SAVE_AT, model=model, optimizer=optimizer,
            loader_state={"step": SAVE_AT, "rank": rank}, rng={"rank": rank}, groups=groups,
            meta={"grid": grid.as_dict()},
        )  # fmt: skip
        full = _full_state(model, optimizer)  # while the save is being written
        after = _train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE))
        checkpointer.wait()
        if rank == 0:
            torch.save(full, f"{job}/full.pt")
        out[grid.describe()] = before + after
        dist.barrier()
    return out


def _load_worlds(rank: int, world: int, cases: list[tuple[Grid, Grid]], root: str) -> dict:
    out = {}
    group = dist.new_group(backend="gloo") if world > 1 else None
    for old, new in cases:
        job = f"{root}/{old.describe()}"
        full = torch.load(f"{job}/full.pt")
        model, optimizer, groups = _build(new, rank)
        loader, rng, meta, _ = load_training_state(
            latest_checkpoint(job), model=model, optimizer=optimizer, groups=groups, group=group
        )
        source = rank if rank < old.world_size else 0
        assert loader == {"step": SAVE_AT, "rank": source} and rng == {"rank": source}
        assert meta["step"] == SAVE_AT
        for name, param in model.named_parameters():
            layout = param.shard_layout
            assert torch.equal(param.detach(), layout.local_from_full(full[name], groups)), name
            for moment in MOMENTS:
                got = optimizer.state[param][moment]
                want = layout.local_from_full(full[moment_key(name, moment)], groups)
                assert torch.equal(got, want), (name, moment)
        out[(old.describe(), new.describe())] = _train(
            model, optimizer, range(SAVE_AT, SAVE_AT + MORE)
        )
        if world > 1:
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints (and uninterrupted losses) of every grid A of ``PAIRS``."""
    root = tmp_path_factory.mktemp("dcp")
    grids = sorted({a for a, _ in PAIRS}, key=lambda g: g.describe())
    losses = {}
    for size in sorted({g.world_size for g in grids}):
        same = [g for g in grids if g.world_size == size]
        losses.update(run_world(_save_worlds, size, same, str(root), timeout=600)[0])
    return root, losses


def test_resume_on_another_grid_continues_the_run(saved):
    root, straight = saved
    results = {}
    for size in sorted({b.world_size for _, b in PAIRS}):
        cases = [(a, b) for a, b in PAIRS if b.world_size == size]
        if size == 1:
            results.update(_in_one_process(cases, str(root)))
        else:
            results.update(run_world(_load_worlds, size, cases, str(root), timeout=600)[0])
    assert len(results) == len(PAIRS) >= 6
    for (old, new), losses in results.items():
        expected = straight[old][SAVE_AT:]
        assert losses == pytest.approx(expected, rel=1e-5), f"{old} -> {new}"


def _in_one_process(cases, root: str) -> dict:
    from axonn_launch.scheduler.processes import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        return _load_worlds(0, 1, cases, root)
    finally:
        dist.destroy_process_group()


def test_stock_dcp_to_torch_save_gives_the_full_state(saved, tmp_path):
    root, _ = saved
    job = root / Grid(x=2, z=2).describe()
    checkpoint = latest_checkpoint(job)
    assert read_meta(checkpoint)["format"] == "dcp/1"
    dcp_to_torch_save(checkpoint, tmp_path / "full.pt")
    exported = torch.load(tmp_path / "full.pt", weights_only=False)
    truth = torch.load(job / "full.pt")
    for key, tensor in truth.items():
        assert torch.equal(exported[key], tensor), key
    names = {k for k in exported if not k.startswith(("optimizer.", "rank_state.", "meta"))}
    assert names == {n for n in truth if not n.startswith("optimizer.")}
    assert {f"rank_state.{r}" for r in range(4)} <= set(exported)
    # each step count, planned by the coordinator alone, is saved once and holds the step
    steps = {k: v for k, v in exported.items() if k.endswith(".step")}
    assert set(steps) == {step_key(n) for n in truth if not n.startswith("optimizer.")}
    assert all(float(v) == SAVE_AT for v in steps.values())


def test_replicated_keys_are_planned_by_the_coordinator_alone():
    """A plain key the same on every rank (AdamW's step counts, the meta string) is in the
    coordinator's local plan only; any other plain key in every rank's, as DCP plans it."""
    state = {"w": torch.zeros(2), "step": torch.tensor(3.0), "bytes": b"x"}

    def planned(coordinator: bool) -> set[str]:
        planner = ShardSavePlanner({}, replicated={"step"})
        planner.set_up_planner(state, is_coordinator=coordinator)
        return {item.index.fqn for item in planner.create_local_plan().items}

    assert planned(True) == {"w", "step", "bytes"}
    assert planned(False) == {"w", "bytes"}


def test_pieces_cover_each_shard_exactly_once_in_natural_order():
    """Every element of every rank's shard is in exactly one box, at its full position;
    padding is in none; every full element is owned by one writing rank."""
    serial = GPT(SPEC, groups=grid_position(Grid(), 0), overlap=OverlapConfig(), seed=3)
    shapes = {n: p.shard_layout.full_shape for n, p in serial.named_parameters()}
    for d, x, y, z in itertools.product([1, 2], [1, 2], [1, 2, 4], [1, 2, 4]):
        grid = Grid(data=d, x=x, y=y, z=z)
        if SPEC.n_head % y or grid.world_size > 8:
            continue
        written = {n: torch.zeros(math.prod(s), dtype=torch.int64) for n, s in shapes.items()}
        model = GPT(SPEC, groups=grid_position(grid, 0), overlap=OverlapConfig(), seed=3)
        layouts = {n: p.shard_layout for n, p in model.named_parameters()}  # same on all ranks
        for rank in range(grid.world_size):
            groups = grid_position(grid, rank)
            for name, layout in layouts.items():
                positions = torch.arange(math.prod(layout.full_shape)).view(layout.full_shape)
                local = layout.local_from_full(positions, groups, fill=-1).reshape(-1)
                covered = torch.zeros(local.numel(), dtype=torch.int64)
                for piece in shard_pieces(layout, groups):
                    for band in band_split(piece, 4, band_bytes=64):
                        box = tuple(
                            slice(o, o + s) for o, s in zip(band.offsets, band.sizes, strict=True)
                        )
                        assert torch.equal(piece_view(local, band), positions[box])
                        covered[band.start : band.start + band.numel] += 1
                        if layout.owns_copy(groups) and groups.coords.data == 0:
                            written[name][positions[box].reshape(-1)] += 1
                assert torch.equal(covered, (local >= 0).long()), (grid, name)
        for name, count in written.items():
            assert bool((count == 1).all()), (grid, name)
