"""Full tensors out of a DCP checkpoint, one tensor at a time; legacy conversion.

``export_checkpoint`` writes ``.pt`` or ``.safetensors``, ``export_hf`` a Hugging Face
directory (Llama), ``convert_legacy`` rewrites a ``per-rank-shards/1`` checkpoint in place.
Memory holds one full tensor at a time, whatever the model size.

How each format is streamed: ``docs/checkpoints.md`` ("train/checkpoint/export.py").
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from axonn_launch.common.jobdir import STEP_META

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
    from axonn_launch.common.grid import Grid
    from axonn_launch.common.models import ModelSpec
    from axonn_launch.common.spec import OverlapConfig, TrainConfig
    from axonn_launch.train.checkpoint.legacy import MOMENTS, gather_full, optimizer_names
    from axonn_launch.train.checkpoint.manager import FORMAT, read_meta
    from axonn_launch.train.checkpoint.state import moment_key, rank_key, step_key
    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.models.optim import build_optimizer
    from axonn_launch.train.parallel.shards import grid_position

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
            state[step_key(name)] = steps[index]
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
    (tmp / STEP_META).write_text(json.dumps(new_meta))
    kept = path.with_name(path.name + ".legacy")
    path.rename(kept)
    tmp.rename(path)
    return kept


# --- Hugging Face Llama directory -----------------------------------------------------


def _spec_of(meta: dict):
    from dataclasses import fields

    from axonn_launch.common.models import ModelSpec

    known = {f.name for f in fields(ModelSpec)}
    return ModelSpec(**{k: v for k, v in meta["model"].items() if k in known})


@dataclass(frozen=True)
class _HFTensor:
    """One HF tensor to write: rows [row0, row0 + shape[0]) of our tensor ``source``."""

    name: str
    source: str
    row0: int
    shape: tuple[int, ...]
    nbytes: int


def hf_plan(path: Path, spec, dtype: torch.dtype) -> list[_HFTensor]:
    """Every HF tensor, in writing order, from the checkpoint's metadata (no data read)."""
    from axonn_launch.common.hf import hf_segments

    entries = tensor_entries(path)
    element = torch.empty((), dtype=dtype).element_size()
    plan = []
    for ours, segments in hf_segments(spec).items():
        if ours not in entries:
            raise ValueError(f"checkpoint {path} has no tensor {ours!r} (model.arch=llama)")
        shape = tuple(entries[ours].size)
        if sum(rows for _, rows in segments) != shape[0]:
            raise ValueError(f"{ours}: checkpoint shape {list(shape)} does not fit {segments}")
        row = 0
        for name, rows in segments:
            part = (rows, *shape[1:])
            plan.append(_HFTensor(name, ours, row, part, math.prod(part) * element))
            row += rows
    return plan


def shard_groups(plan: list[_HFTensor], max_bytes: int) -> list[list[_HFTensor]]:
    """Consecutive tensors packed into files of at most ``max_bytes`` (a larger tensor
    gets a file of its own), as transformers' ``save_pretrained`` does."""
    groups: list[list[_HFTensor]] = [[]]
    size = 0
    for item in plan:
        if groups[-1] and size + item.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return groups


class _SafetensorsFile:
    """A safetensors file written tensor by tensor after a header computed up front."""

    def __init__(self, path: Path, items: list[_HFTensor], dtype: torch.dtype) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for item in items:
            header[item.name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(item.shape),
                "data_offsets": [offset, offset + item.nbytes],
            }
            offset += item.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.expected = [item.name for item in items]
        self.handle = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.handle.write(struct.pack("<Q", len(encoded)))
        self.handle.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self.expected and self.expected[0] == name, (name, self.expected[:1])
        self.expected.pop(0)
        self.handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        assert not self.expected, self.expected
        self.handle.close()


class _ShardFiles:
    """The shard files in order: the next one opens when a tensor of it comes."""

    def __init__(self, directory: Path, names: list[str], groups: list[list[_HFTensor]],
                 where: dict[str, int], dtype: torch.dtype) -> None:  # fmt: skip
        self.directory, self.names, self.groups, self.where = directory, names, groups, where
        self.dtype, self.current, self.file = dtype, -1, None

    def write(self, item: _HFTensor, tensor: torch.Tensor) -> None:
        if self.where[item.name] != self.current:
            self.close()
            self.current = self.where[item.name]
            path = self.directory / self.names[self.current]
            self.file = _SafetensorsFile(path, self.groups[self.current], self.dtype)
        self.file.write(item.name, tensor)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _write_rows(files: _ShardFiles, full: torch.Tensor, items: list[_HFTensor]) -> None:
    """Cut one of our full tensors into its HF tensors (returning frees it)."""
    for item in items:
        files.write(item, full.narrow(0, item.row0, item.shape[0]).to(files.dtype))


def _hf_extras(spec, config: dict) -> dict:
    """Token ids of the original model's config.json (init_from), when there is one."""
    from axonn_launch.common.hf import CONFIG

    source = Path(spec.init_from) / CONFIG if spec.init_from else None
    if source is None or not source.is_file():
        return config
    try:
        original = json.loads(source.read_text())
    except ValueError:
        return config
    keep = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {**config, **{k: original[k] for k in keep if k in original}}


def export_hf(
    path: Path, out: Path, *, dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 10**9
) -> tuple[int, int, list[str]]:
    """Write the Llama checkpoint at ``path`` as a Hugging Face directory ``out``.

    Our tensors are read one at a time (``read_full``) and cut by rows into their HF
    tensors (``hf_segments``), which are streamed into ``model-0000k-of-0000n.safetensors``
    files (one file: ``model.safetensors``) with ``model.safetensors.index.json``; plus
    config.json and the tokenizer files of the model's ``init_from`` directory when it
    exists. Everything is written to a hidden sibling directory renamed to ``out`` at
    the end. Returns (HF tensors, files, tokenizer files copied).
    """
    from axonn_launch.common.hf import INDEX, SINGLE, TOKENIZER_FILES, hf_config_from_spec
    from axonn_launch.train.checkpoint.manager import read_meta

    spec = _spec_of(read_meta(path))
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config = _hf_extras(spec, hf_config_from_spec(spec, dtype=dtype_name))
    plan = hf_plan(path, spec, dtype)
    groups = shard_groups(plan, max_shard_bytes)
    n = len(groups)
    names = (
        [SINGLE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    where = {item.name: k for k, group in enumerate(groups) for item in group}
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = []
        source = Path(spec.init_from) if spec.init_from else None
        if source is not None and source.is_dir():
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / name)
                    copied.append(name)
        entries = tensor_entries(path)
        files = _ShardFiles(tmp, names, groups, where, dtype)
        by_source: dict[str, list[_HFTensor]] = {}
        for item in plan:
            by_source.setdefault(item.source, []).append(item)
        for ours, items in by_source.items():
            _write_rows(files, read_full(path, ours, entries[ours]), items)
        files.close()
        if n > 1:
            index = {
                "metadata": {
                    "total_size": sum(item.nbytes for item in plan),
                    "total_parameters": sum(math.prod(item.shape) for item in plan),
                },
                "weight_map": {item.name: names[where[item.name]] for item in plan},
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # the caller checked that it is empty
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(plan), n, copied
