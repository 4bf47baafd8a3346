"""Host memory and initialization time one rank needs to start, save and resume.

Torch-free (the planner prints it on a login node); ``bench/bench_checkpoint.py``
compares these predictions with measurements. The shard is the training core's
(``memory.local_param_elements``).

What each term counts: ``docs/cost-model.md`` ("cost/jobcost.py").
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.traffic import block_linears, largest_linear_block
from axonn_launch.cost.memory import GIB, local_param_elements

PARAM_BYTES_PER_ELEMENT = 4
STATE_BYTES_PER_ELEMENT = 16  # parameter 4 + gradient 4 + exp_avg 4 + exp_avg_sq 4
STAGED_BYTES_PER_ELEMENT = 12  # the async save's host copy: parameter and both moments
READ_CHUNK_BYTES = 32 << 20  # largest saved chunk (train/parallel/shards.py BAND_BYTES)
METADATA_BYTES_PER_CHUNK = 1000  # one chunk of the loaded DCP metadata in memory (measured: ~900)
PROCESS_BYTES = (
    340 << 20
)  # peak RSS of a rank of a tiny model that saved: Python, torch, gloo, DCP (bench)
INIT_ELEMENTS_PER_S = 25e6  # train/parallel/init.py generator, one CPU core (bench)


@dataclass(frozen=True)
class JobCost:
    shard_elements: float
    chunks: int
    on_gpu: bool
    start_bytes: float
    save_bytes: float
    resume_bytes: float
    init_s: float

    @property
    def peak_bytes(self) -> float:
        return max(self.start_bytes, self.save_bytes, self.resume_bytes)

    def describe(self) -> str:
        where = "GPU" if self.on_gpu else "host"
        bound = "<= " if self.on_gpu else ""
        return (
            f"per rank: {self.shard_elements / 1e6:.1f}M parameters "
            f"({STATE_BYTES_PER_ELEMENT * self.shard_elements / GIB:.2f} GiB of training "
            f"state in {where} memory); host memory at start "
            f"{self.start_bytes / GIB:.2f} GiB, while saving {self.save_bytes / GIB:.2f} GiB, "
            f"resuming {self.resume_bytes / GIB:.2f} GiB; initialization {bound}"
            f"{self.init_s:.2f} s ({INIT_ELEMENTS_PER_S / 1e6:.0f}M elements/s on one core)"
        )


def flat_range_boxes(rows: int, cols: int, parts: int, segments: int = 1) -> int:
    """Boxes of the ``parts`` flat chunks of a row-major (rows x cols) block whose rows
    fall into ``segments`` equal runs of consecutive full rows (train/parallel/shards.py), each box
    cut into bands of at most ``READ_CHUNK_BYTES`` (fp32)."""
    numel, per = rows * cols, -(-rows * cols // parts)
    seg_rows = rows // segments
    boxes = 0
    for index in range(parts):
        pos, end = min(numel, index * per), min(numel, (index + 1) * per)
        while pos < end:
            row, col = divmod(pos, cols)
            if col == 0 and end - pos >= cols:
                k = (end - pos) // cols
                first, last = row // seg_rows, (row + k - 1) // seg_rows
                band_rows = max(1, READ_CHUNK_BYTES // (4 * cols))
                boxes += (last - first + 1) + (k - 1) // band_rows
                pos += k * cols
            else:
                boxes += 1
                pos += min(cols - col, end - pos)
    return boxes


def checkpoint_chunks(model: ModelSpec, grid: Grid) -> int:
    """Saved chunks of a checkpoint: every parameter's boxes, written once, times three
    (the parameter and both moments)."""
    x, y, z = grid.x, grid.y, grid.z
    weights = 0
    for lin in block_linears(model):  # each distinct block, its runs (q|k|v, gate|up) kept
        rows, cols = lin.fan_out // lin.out_split(grid), lin.fan_in // grid.size(lin.inner)
        blocks = grid.size(lin.inner) * lin.out_split(grid)
        weights += blocks * flat_range_boxes(rows, cols, z, segments=lin.segments)
    arch = model.architecture  # biases, norms, positions: a box per tensor, shard and run
    small = sum(param.boxes(grid) for param in arch.layer_small_params(model))
    extra = sum(param.boxes(grid) for param in arch.model_small_params(model))
    plane = x * y
    vocab_rows = -(-model.vocab_size // plane)
    tables = model.vocab_tables * plane * flat_range_boxes(vocab_rows, model.d_model, z)
    return 3 * (model.n_layer * (weights + small) + tables + extra)


def largest_block_elements(model: ModelSpec, grid: Grid) -> float:
    """The largest weight block a rank gathers over z: a Linear's block or its token rows."""
    plane = grid.x * grid.y
    return max(largest_linear_block(model, grid), -(-model.vocab_size // plane) * model.d_model)


def job_cost(
    model: ModelSpec,
    grid: Grid,
    *,
    on_gpu: bool,
    process_bytes: float = PROCESS_BYTES,
    init_rate: float = INIT_ELEMENTS_PER_S,
) -> JobCost:
    shard = local_param_elements(model, grid)
    chunks = checkpoint_chunks(model, grid)
    metadata = chunks * METADATA_BYTES_PER_CHUNK
    device = 0 if on_gpu else 1  # 1: the training state lives in host memory
    return JobCost(
        shard_elements=shard,
        chunks=chunks,
        on_gpu=on_gpu,
        start_bytes=process_bytes + device * PARAM_BYTES_PER_ELEMENT * shard,
        save_bytes=process_bytes
        + (device * STATE_BYTES_PER_ELEMENT + STAGED_BYTES_PER_ELEMENT) * shard
        + device * 2 * PARAM_BYTES_PER_ELEMENT * largest_block_elements(model, grid)
        + metadata,
        resume_bytes=process_bytes
        + device * STAGED_BYTES_PER_ELEMENT * shard  # parameters and moments
        + READ_CHUNK_BYTES
        + metadata,
        init_s=shard / init_rate,
    )
