"""Whether a model and a training configuration can run on a grid: every rule, once.

The login node (``validate``, ``plan``) and the job (``train.validate_shapes``) ask the
same functions, and each rule mirrors what the job's layers and loader require
(``train/layers.py``, ``train/model.py``, ``train/data.py``; ``tests/test_rules.py``
builds them to check that the two agree). Torch-free. Each rule returns None or one line
naming the field, its value and what would be valid.

The sharding the rules follow (AxoNN, axonn.md §2.3): attention heads are split over y
and the hidden dimension over x; each Linear's weight is cut into an x*y grid of blocks
(rows over one axis, columns over the other) and every block is flattened and split over
z. The token table is padded with zero rows to a multiple of x*y, split by rows over the
x*y plane, and each plane member's block is flattened and split over z. Position table,
biases and LayerNorms are split over x or y only. Every micro-batch is split over z.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from axonn_launch.grid import Grid
from axonn_launch.machine import Hardware
from axonn_launch.models import ModelSpec
from axonn_launch.spec import TrainConfig

if TYPE_CHECKING:
    from axonn_launch.memory import MemoryEstimate

LISTED_DIVISORS = 12  # a "valid" list names at most this many values


# --------------------------------------------------------------------------- shard sizes


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def padded_vocab(vocab_size: int, grid: Grid) -> int:
    """Token-table rows after padding to a multiple of the x*y plane."""
    plane = grid.x * grid.y
    return -(-vocab_size // plane) * plane


def local_vocab(vocab_size: int, grid: Grid) -> int:
    """Token-table rows one plane member holds (before the split over z)."""
    return padded_vocab(vocab_size, grid) // (grid.x * grid.y)


def z_blocks(model: ModelSpec, grid: Grid) -> dict[str, int]:
    """Elements of each block that is flattened and split over z, by name.

    QKV [3h/y, h/x], attention projection [h/x, h/y], MLP up [f/y, h/x], MLP down
    [h/x, f/y], token table [V_l, h] with V_l = padded vocab / (x*y). Valid only when
    ``shape_problem`` finds no problem with heads and hidden over x and y.
    """
    h, f, x, y = model.d_model, model.d_ff, grid.x, grid.y
    return {
        "QKV weight block": (3 * h // y) * (h // x),
        "attention projection block": (h // x) * (h // y),
        "MLP weight block": (f // y) * (h // x),
        "token table block": local_vocab(model.vocab_size, grid) * h,
    }


# --------------------------------------------------------------------------- the rules


def model_problem(model: ModelSpec) -> str | None:
    """The model alone: whole heads (the QKV view in ``Attention``)."""
    if model.d_model % model.n_head:
        return (
            f"model.d_model={model.d_model}: must be divisible by model.n_head={model.n_head}"
            f"; valid n_head: {_divisors(model.d_model)}"
        )
    return None


def shape_problem(model: ModelSpec, grid: Grid) -> str | None:
    """Why the model's tensors cannot be split over the grid's x, y and z, or None."""
    if model.n_head % grid.y:
        return (
            f"grid.y={grid.y}: must divide model.n_head={model.n_head} (heads are split over y)"
            f"; valid y: {_divisors(model.n_head)}"
        )
    if model.d_model % grid.x:
        return (
            f"grid.x={grid.x}: must divide model.d_model={model.d_model} (the hidden dimension"
            f" is split over x); valid x: {_divisors(model.d_model)}"
        )
    blocks = z_blocks(model, grid)
    for name, elements in blocks.items():
        if elements % grid.z:
            return (
                f"grid.z={grid.z}: must divide the {name} of {elements} elements per x*y shard"
                f"{_vocab_note(model, grid) if name.startswith('token') else ''}"
                f"; valid z: {_divisors(math.gcd(*blocks.values()))}"
            )
    return None


def seq_len_problem(model: ModelSpec, train: TrainConfig) -> str | None:
    """The position table has ``max_seq_len`` rows."""
    if train.seq_len > model.max_seq_len:
        return f"train.seq_len={train.seq_len}: must be <= model.max_seq_len={model.max_seq_len}"
    return None


def micro_batch_candidates(train: TrainConfig, grid: Grid) -> list[int]:
    """Valid micro-batches for this grid and global batch, largest first."""
    if train.global_batch % grid.data:
        return []
    per_replica = train.global_batch // grid.data
    return [m for m in reversed(divisors(per_replica)) if m % grid.z == 0]


def batch_problem(train: TrainConfig, grid: Grid) -> str | None:
    """Each z rank takes micro_batch/z sequences; a step is whole micro-steps of every
    data replica. With ``train.micro_batch`` None (automatic), whether any value works."""
    if train.micro_batch is None:
        if train.global_batch % (grid.data * grid.z):
            return (
                f"train.global_batch={train.global_batch}: must be a multiple of"
                f" grid.data*grid.z={grid.data * grid.z} (each data replica's z ranks need"
                " whole sequences)"
            )
        return None
    valid = _valid_micro_batches(train, grid)
    if train.micro_batch % grid.z:
        return (
            f"train.micro_batch={train.micro_batch}: must be divisible by grid.z={grid.z}"
            f" (each z rank takes micro_batch/z sequences){valid}"
        )
    step = train.micro_batch * grid.data
    if train.global_batch % step:
        return (
            f"train.global_batch={train.global_batch}: must be a multiple of"
            f" train.micro_batch*grid.data={step}{valid}"
        )
    return None


def throughput_problem(model: ModelSpec, train: TrainConfig) -> str | None:
    """Weight caching covers whole blocks of the model; the ORS window counts blocks."""
    if train.cache_layers is not None and not 0 <= train.cache_layers <= model.n_layer:
        return (
            f"train.cache_layers={train.cache_layers}: must be between 0 and"
            f" model.n_layer={model.n_layer} (blocks whose gathered weights are kept)"
        )
    if train.ors_window < 0:
        return (
            f"train.ors_window={train.ors_window}: must be >= 0 (blocks of pending"
            " weight-grad reduce-scatters; 0 = no bound)"
        )
    return None


def job_problem(model: ModelSpec, grid: Grid, train: TrainConfig) -> str | None:
    """Every rule the job itself depends on (all but memory), first problem first."""
    return (
        model_problem(model)
        or shape_problem(model, grid)
        or seq_len_problem(model, train)
        or batch_problem(train, grid)
        or throughput_problem(model, train)
    )


# --------------------------------------------------------------------------- memory


def fit_micro_batch(
    model: ModelSpec, grid: Grid, train: TrainConfig, hardware: Hardware
) -> tuple[int, MemoryEstimate] | str:
    """The micro-batch to run and its memory estimate (``memory.py``), or why none can.

    A given ``train.micro_batch`` must be valid and fit. None (automatic) takes the
    largest valid one that fits: it gives the fewest micro-steps, hence the fewest weight
    all-gathers and reduce-scatters over z, which repeat per micro-step.
    """
    why = batch_problem(train, grid)
    if why:
        return why
    if train.micro_batch is None:
        candidates = micro_batch_candidates(train, grid)
    else:
        candidates = [train.micro_batch]
    for micro in candidates:
        estimate = _estimate(model, grid, replace(train, micro_batch=micro))
        if estimate.fits(hardware.mem_per_gpu_gb):
            return micro, estimate
    gib = 1024**3
    name, value = estimate.biggest()
    return (
        f"grid ({grid.describe()}) with train.micro_batch={micro}: needs"
        f" {estimate.total / gib:.1f} GiB per GPU but a {hardware.gpu_model} has"
        f" {hardware.mem_per_gpu_gb:g} GiB (largest term: {name} {value / gib:.1f} GiB); use"
        " more z/x/y ranks, a smaller micro_batch or train.activation_checkpointing=true"
    )


def _estimate(model: ModelSpec, grid: Grid, train: TrainConfig) -> MemoryEstimate:
    from axonn_launch.memory import estimate_memory  # memory.py builds on this module

    return estimate_memory(model=model, grid=grid, train=train)


# --------------------------------------------------------------------------- wording


def _valid_micro_batches(train: TrainConfig, grid: Grid) -> str:
    candidates = micro_batch_candidates(train, grid)
    if not candidates:
        return ""
    shown = ", ".join(map(str, candidates[:LISTED_DIVISORS]))
    return f"; valid micro_batch: {shown}{', ...' if len(candidates) > LISTED_DIVISORS else ''}"


def _vocab_note(model: ModelSpec, grid: Grid) -> str:
    rows = local_vocab(model.vocab_size, grid)
    return (
        f" (model.vocab_size={model.vocab_size} padded to {rows} rows per member of the"
        f" x*y={grid.x * grid.y} plane, times model.d_model={model.d_model})"
    )


def _divisors(n: int) -> str:
    values = divisors(n)
    if len(values) <= LISTED_DIVISORS:
        return ", ".join(map(str, values))
    return ", ".join(map(str, values[:LISTED_DIVISORS])) + f", ... (the divisors of {n})"
