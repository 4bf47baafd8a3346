"""python -m axonn_launch.export: full tensors to .pt and safetensors; legacy conversion."""

from __future__ import annotations

import json
import os
import struct
import subprocess

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.export import main
from axonn_launch.train.checkpoint.manager import Checkpointer, latest_checkpoint, read_meta
from axonn_launch.train.checkpoint.state import MOMENTS, load_training_state, save_training_state
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.optim import build_optimizer
from axonn_launch.train.parallel.shards import grid_position
from tests.cli_server import run_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SPEC = ModelSpec("t", n_layer=1, d_model=16, n_head=2, vocab_size=37, max_seq_len=8)


def _model(grid: Grid, rank: int):
    groups = grid_position(grid, rank)
    model = GPT(SPEC, groups=groups, overlap=OverlapConfig(), seed=5)
    return model, build_optimizer(model, TrainConfig()), groups


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A one-process job directory with a DCP checkpoint of a model with moments."""
    job = tmp_path_factory.mktemp("job")
    model, optimizer, groups = _model(Grid(), 0)
    gen = torch.Generator().manual_seed(1)
    for param in model.parameters():
        optimizer.state[param] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(param.shape, generator=gen),
            "exp_avg_sq": torch.rand(param.shape, generator=gen),
        }
    checkpointer = Checkpointer(job, rank=0, keep=1)
    save_training_state(checkpointer, 3, model=model, optimizer=optimizer,
                        loader_state={"step": 3}, rng={}, groups=groups,
                        meta={"grid": Grid().as_dict()})  # fmt: skip
    checkpointer.wait()
    return job


def _stock(job, tmp_path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(latest_checkpoint(job), tmp_path / "stock.pt")
    full = torch.load(tmp_path / "stock.pt", weights_only=False)
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}


def _read_safetensors(path) -> dict[str, torch.Tensor]:
    """An independent reader of the format: u64 header length, JSON header, raw bytes."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    body = data[8 + length :]
    kinds = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=kinds[entry["dtype"]]).reshape(entry["shape"])
        out[name] = torch.from_numpy(array.copy())
    return out


@pytest.mark.parametrize("target", ["full.pt", "full.safetensors", "hf_dir"])
def test_export_equals_the_stock_reader(job, tmp_path, target):
    out = tmp_path / target
    assert main([str(job), "--to", str(out)]) == 0
    if target.endswith(".pt"):
        exported = torch.load(out, weights_only=True)
    else:
        exported = _read_safetensors(out / "model.safetensors" if target == "hf_dir" else out)
    stock = _stock(job, tmp_path)
    assert exported.keys() == stock.keys()
    for name, tensor in stock.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    names = {n for n, _ in GPT(SPEC, groups=grid_position(Grid(), 0), overlap=OverlapConfig())
             .named_parameters()}  # fmt: skip
    assert names <= stock.keys()
    assert stock["blocks.0.attn.qkv.weight"].shape == (48, 16)  # full shape, natural rows


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.export", list(args), cwd=os.getcwd(), timeout=600)


def test_bad_input_is_one_line_and_exit_2(job, tmp_path):
    missing = _cli(str(tmp_path / "nowhere"), "--to", str(tmp_path / "x.pt"))
    assert missing.returncode == 2 and "checkpoint=" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    suffix = _cli(str(job), "--to", str(tmp_path / "x.npz"))
    assert suffix.returncode == 2 and "--to=" in suffix.stderr and ".safetensors" in suffix.stderr
    no_to = _cli(str(job))
    assert no_to.returncode == 2 and "--to" in no_to.stderr
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.npz").exists()
    usage = _cli("--help")
    assert usage.returncode == 0 and "--convert-legacy" in usage.stdout


def test_a_legacy_checkpoint_is_converted_and_resumes_on_another_grid(tmp_path):
    """A per-rank-shards/1 checkpoint of grid x=2,z=2 (written in that format's layout)
    is converted in place and then loads on one rank with the same full state."""
    from tests.train.checkpoint.test_legacy import write_fixture

    step_dir = tmp_path / "checkpoints" / "step_00000005"
    full = write_fixture(step_dir, Grid(x=2, z=2))
    (tmp_path / "checkpoints" / "latest").write_text(step_dir.name)
    assert main(["--convert-legacy", str(tmp_path)]) == 0
    assert read_meta(latest_checkpoint(tmp_path))["format"] == "dcp/1"
    assert (tmp_path / "checkpoints" / "step_00000005.legacy" / "rank_00003.pt").exists()

    model, optimizer, groups = _legacy_model()
    loader, rng, meta, _ = load_training_state(
        latest_checkpoint(tmp_path), model=model, optimizer=optimizer, groups=groups
    )
    assert loader == {"step": 5, "rank": 0} and meta["step"] == 5
    for name, param in model.named_parameters():
        layout = param.shard_layout
        assert torch.equal(param.detach(), layout.local_from_full(full[name], groups)), name
        for m in MOMENTS:
            want = layout.local_from_full(full[f"{name}.{m}"], groups)
            assert torch.equal(optimizer.state[param][m], want), (name, m)
        assert float(optimizer.state[param]["step"]) == 5.0


def _legacy_model():
    from tests.train.checkpoint.test_legacy import sharded_model

    return sharded_model(Grid(), 0)


def _meta_only(tmp_path, arch: str) -> str:
    """A step directory with just meta.json: enough for the torch-free checks."""
    step = tmp_path / f"{arch}_ckpt"
    step.mkdir()
    model = {"name": "m", "n_layer": 1, "d_model": 16, "n_head": 2, "vocab_size": 37,
             "max_seq_len": 8, "arch": arch}  # fmt: skip
    (step / "meta.json").write_text(json.dumps({"format": "dcp/1", "model": model}))
    return str(step)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--hf", "{out}", "--dtype", "fp16"], "--dtype='fp16': expected one of fp32, bf16"),
        (["--hf", "{out}", "--max-shard-size", "5XB"], "--max-shard-size='5XB': expected a"),
        (["--hf", "{out}", "--max-shard-size", "0"], "--max-shard-size='0'"),
        (["--hf", "{out}", "--to", "{out}.pt"], "--to and --hf: give one of them"),
        (["--to", "{out}.pt", "--dtype", "bf16"], "--dtype and --max-shard-size go with --hf"),
        (["--hf"], "--hf needs a value"),
        (["--hf", "{full}"], "exists and is not an empty directory"),
        (["--hf", "{nowhere}/x"], "does not exist"),
    ],
)
def test_hf_export_bad_input(tmp_path, capsys, args, words):
    llama = _meta_only(tmp_path, "llama")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    paths = {"out": tmp_path / "out", "full": tmp_path / "full", "nowhere": tmp_path / "no"}
    argv = [llama] + [a.format(**paths) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]


def test_hf_export_is_for_llama_checkpoints(job, tmp_path):
    gpt = _cli(_meta_only(tmp_path, "gpt"), "--hf", str(tmp_path / "out"))
    assert gpt.returncode == 2 and len(gpt.stderr.strip().splitlines()) == 1
    assert "model.arch='gpt'" in gpt.stderr and "for Llama models" in gpt.stderr
    no_model = main([str(job), "--hf", str(tmp_path / "out")])  # meta.json without a model
    assert no_model == 2 and not (tmp_path / "out").exists()
    assert main([str(job), "--to", str(tmp_path / "still.pt")]) == 0  # --to works for GPT
