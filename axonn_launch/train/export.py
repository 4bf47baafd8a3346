"""Full tensors out of a DCP checkpoint, one tensor at a time; legacy conversion.

``export_checkpoint`` reads each tensor of the checkpoint in full (``dcp.load`` of one
key, single process) and appends it to the output before reading the next, so memory
holds one full tensor (plus the saved chunk being copied), whatever the model size:

* ``.pt``: torch's zip format written record by record (the pickle references each
  tensor's storage record; ``torch.load(..., weights_only=True)`` reads it);
* ``.safetensors`` (or a directory, which gets ``model.safetensors``): the header is
  computed from the metadata first, then the tensors' bytes follow in order.

``convert_legacy`` turns a ``per-rank-shards/1`` checkpoint into a DCP one in place (the
old directory is kept beside it as ``<name>.legacy``). It rebuilds full tensors in one
process (``axonn_launch.train.legacy``), which the old format leaves no way around.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import shutil
import struct
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def tensor_entries(path: Path) -> dict[str, TensorStorageMetadata]:
    """Name -> metadata of every tensor in the checkpoint, in name order."""
    metadata = FileSystemReader(path).read_metadata()
    entries = {
        k: md
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    return dict(sorted(entries.items()))


def read_full(path: Path, name: str, md: TensorStorageMetadata) -> torch.Tensor:
    """One full tensor of the checkpoint (single process, no process group)."""
    state = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state[name]


def export_checkpoint(path: Path, out: Path) -> int:
    """Write every tensor of the checkpoint at ``path`` to ``out``; returns the count."""
    entries = tensor_entries(path)
    if out.suffix == ".pt":
        _write_torch(path, entries, out)
    else:
        target = out / "model.safetensors" if out.suffix != ".safetensors" else out
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_safetensors(path, entries, target)
    return len(entries)


# --- torch.save format, one record at a time -----------------------------------------


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as the tensor torch.save would write for a contiguous CPU tensor."""

    def __init__(self, key: str, md: TensorStorageMetadata) -> None:
        shape = tuple(md.size)
        self.storage = _StorageRef(key, md.properties.dtype, math.prod(shape))
        self.shape, self.stride = shape, _contiguous_stride(shape)

    def __reduce_ex__(self, protocol):
        args = (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if not isinstance(obj, _StorageRef):
            return None
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
        return ("storage", storage_type, obj.key, "cpu", obj.numel)


def _write_torch(path: Path, entries: dict, out: Path) -> None:
    refs = {name: _TensorRef(str(i), md) for i, (name, md) in enumerate(entries.items())}
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(refs)
    writer = torch._C.PyTorchFileWriter(str(out))
    data = buffer.getvalue()
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for name, md in entries.items():
        tensor = read_full(path, name, md).contiguous()
        storage = tensor.untyped_storage()
        writer.write_record(f"data/{refs[name].storage.key}", storage, storage.nbytes())
        del tensor, storage
    writer.write_end_of_file()


# --- safetensors ----------------------------------------------------------------------


def _write_safetensors(path: Path, entries: dict, out: Path) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, md in entries.items():
        dtype = md.properties.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors equivalent")
        nbytes = math.prod(md.size) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(md.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    part = out.with_name(out.name + ".part")
    with open(part, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name, md in entries.items():
            tensor = read_full(path, name, md).contiguous()
            handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    part.replace(out)


# --- per-rank-shards/1 -> DCP ---------------------------------------------------------


def convert_legacy(path: Path) -> Path:
    """Rewrite the legacy checkpoint ``path`` as a DCP checkpoint under the same name."""
    from axonn_launch.grid import Grid
    from axonn_launch.models import ModelSpec
    from axonn_launch.spec import OverlapConfig, TrainConfig
    from axonn_launch.train.checkpoint import FORMAT, read_meta
    from axonn_launch.train.dcp import grid_position
    from axonn_launch.train.legacy import MOMENTS, gather_full, optimizer_names
    from axonn_launch.train.loop import build_optimizer
    from axonn_launch.train.model import GPT
    from axonn_launch.train.state import moment_key, rank_key

    meta = read_meta(path)
    spec = ModelSpec(**meta["model"])
    model = GPT(spec, groups=grid_position(Grid(), 0), overlap=OverlapConfig())
    names = optimizer_names(model, build_optimizer(model, TrainConfig()))
    full, moments, steps, small = gather_full(path, Grid(**meta["grid"]), model, names)
    shapes = {n: p.shard_layout.full_shape for n, p in model.named_parameters()}
    state: dict[str, object] = {n: full[n].view(shapes[n]) for n in shapes}
    for index, name in enumerate(names):
        if (name, MOMENTS[0]) in moments:
            for moment in MOMENTS:
                state[moment_key(name, moment)] = moments[(name, moment)].view(shapes[name])
            state[f"optimizer.state.{name}.step"] = steps[index]
    for rank, entry in enumerate(small):
        buffer = io.BytesIO()
        torch.save(entry, buffer)
        state[rank_key(rank)] = buffer.getvalue()
    new_meta = {**meta, "format": FORMAT}
    state["meta"] = json.dumps(new_meta)
    tmp = path.with_name(f".tmp_convert_{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
    (tmp / "meta.json").write_text(json.dumps(new_meta))
    kept = path.with_name(path.name + ".legacy")
    path.rename(kept)
    tmp.rename(path)
    return kept
