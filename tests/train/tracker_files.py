"""Reading back what the metric sinks wrote, with the trackers' own readers: TensorBoard's
``EventAccumulator``, and W&B's offline transaction log (``run-<id>.wandb``: LevelDB's log
format, https://github.com/google/leveldb/blob/main/doc/log_format.md, after W&B's 7-byte
header, each record a ``wandb.proto.wandb_internal_pb2.Record``). wandb 0.31 has no Python
reader of its own for that file (its sync is in the Go ``wandb-core``), so it is parsed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BLOCK = 32768  # LevelDB log blocks
HEADER = 7  # a chunk's header: crc32c (4), length (2), type (1); W&B's file header too
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tb_series(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it, in the order read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def as_float32(value: float) -> float:
    """What a float64 from metrics.jsonl is in an event file (TensorBoard keeps float32)."""
    return float(np.float32(value))


def jsonl_losses(job_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log, reassembled from their chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """Each ``run.log`` of an offline run folder: its ``_step`` and its values."""
    from wandb.proto.wandb_internal_pb2 import Record

    (log,) = run_dir.glob("run-*.wandb")
    rows = []
    for raw in wandb_records(log):
        record = Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            rows.append(items)
    return rows
