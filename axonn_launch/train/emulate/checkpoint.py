"""An emulated checkpoint: DCP's files in their real count and names, sizes scaled down.

Each rank writes its ``__<rank>_0.distcp`` into ``checkpoints/.tmp_step_<n>``; rank 0
writes ``.metadata`` and ``meta.json``, renames the folder to ``step_<n>``, points
``latest`` at it and keeps ``train.keep_checkpoints``, as ``train/checkpoint/manager.py``
publishes a real save. Every file holds ``SCALE`` of its real size (at least a byte);
``meta.json`` records the real sizes beside it.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from axonn_launch.common.jobdir import LATEST, STEP_META, JobPaths, write_json_atomically
from axonn_launch.common.spec import JobSpec

SCALE = 1e-6  # bytes written per real byte
FORMAT = "emulated"  # meta.json's format: no real resume reads it as weights
METADATA_BYTES_PER_RANK = 24_000  # .metadata per rank (a 2-rank gpt_tiny save: 47.7 kB)


def real_bytes_per_rank(spec: JobSpec) -> int:
    """What a rank's file holds in the real job: its share of the fp32 weights and two
    Adam moments (12 bytes per parameter), replicas deduplicated over the world."""
    return math.ceil(spec.model.n_params() * 12 / spec.grid.world_size)


def scaled(size: int) -> int:
    return max(1, math.ceil(size * SCALE))


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def staging(job_dir: str | Path, step: int) -> Path:
    return JobPaths(job_dir).checkpoints / f".tmp_{step_name(step)}"


def prepare(job_dir: str | Path, step: int) -> None:
    """Rank 0, before every rank writes: an empty staging folder."""
    tmp = staging(job_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def write_shard(job_dir: str | Path, step: int, rank: int, size: int) -> None:
    (staging(job_dir, step) / f"__{rank}_0.distcp").write_bytes(b"\0" * scaled(size))


def publish(spec: JobSpec, step: int, meta: dict) -> Path:
    """Rank 0, after every rank wrote: ``.metadata``, ``meta.json``, the rename, ``latest``."""
    root, tmp, name = (
        JobPaths(spec.job_dir).checkpoints,
        staging(spec.job_dir, step),
        step_name(step),
    )
    world, per_rank = spec.grid.world_size, real_bytes_per_rank(spec)
    (tmp / ".metadata").write_bytes(b"\0" * scaled(METADATA_BYTES_PER_RANK * world))
    real = {"scale": SCALE, "bytes_per_rank": per_rank, "bytes": per_rank * world,
            "metadata_bytes": METADATA_BYTES_PER_RANK * world}  # fmt: skip
    write_json_atomically(tmp / STEP_META, meta | {"step": step, "format": FORMAT, "real": real})
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / f"{LATEST}.part").write_text(name)
    os.replace(root / f"{LATEST}.part", root / LATEST)
    prune(root, spec.train.keep_checkpoints)
    return final


def prune(root: Path, keep: int) -> None:
    """All but the newest ``keep`` steps go (``keep <= 0``: all are kept)."""
    if keep <= 0:
        return
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
