"""Hugging Face Llama weights in and out: ``load_hf_weights`` on 1 and 4 gloo ranks
(each rank reads only its shard's bytes), and ``export --hf`` loaded back by
transformers. Tiny random models are built here, nothing is downloaded."""

from __future__ import annotations

import json
import weakref
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from axonn_launch.common.grid import Grid
from axonn_launch.common.hf import hf_segments, spec_from_hf_config
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.export import main
from axonn_launch.train.checkpoint import export as train_export
from axonn_launch.train.checkpoint.manager import Checkpointer
from axonn_launch.train.checkpoint.state import save_training_state
from axonn_launch.train.models.gpt import full_state_dict, load_full_state_dict
from axonn_launch.train.models.hf_import import load_hf_weights
from axonn_launch.train.models.optim import build_optimizer
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.groups import build_groups
from axonn_launch.train.parallel.shards import grid_position, shard_pieces
from tests.train.dist_utils import run_world

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tf():
    """transformers, imported only where used (the gloo ranks never need it)."""
    return pytest.importorskip("transformers")


SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)  # fmt: skip
SCALED = dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32})  # fmt: skip
GRIDS = [Grid(x=2, z=2), Grid(y=2, z=2), Grid(x=4), Grid(z=4), Grid(y=4), Grid(x=2, y=2),
         Grid(data=2, x=2)]  # fmt: skip
SAVE_GRID = Grid(x=2, z=2)  # its checkpoint (of the unchanged HF weights) is exported below


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    _tf().PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """sharded: untied, 6 files + index, a tokenizer; tied: tied, llama3 rope scaling,
    one file; bf16: the sharded model's weights stored in bf16; odd: vocabulary 502."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    untied = _tf().LlamaForCausalLM(_tf().LlamaConfig(**SHAPE))
    untied.save_pretrained(root / "sharded", max_shard_size="100KB")
    _tokenizer(root / "sharded")
    untied.to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="100KB")
    tied = _tf().LlamaForCausalLM(_tf().LlamaConfig(**SHAPE, **SCALED))
    tied.save_pretrained(root / "tied")
    odd = _tf().LlamaForCausalLM(_tf().LlamaConfig(**{**SHAPE, "vocab_size": 502}))
    odd.save_pretrained(root / "odd", max_shard_size="100KB")  # padded vocab over x*y = 4
    names = ("sharded", "tied", "bf16", "odd")
    return {name: root / name for name in names}


def _spec(hf_dir: Path):
    config = json.loads((hf_dir / "config.json").read_text())
    return spec_from_hf_config(config, hf_dir.name)


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF directory (test-side reference: reads everything)."""
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _full_from_hf(hf_dir: Path, spec) -> dict[str, torch.Tensor]:
    """Our full tensors, concatenated from the HF tensors and converted to fp32."""
    tensors = _hf_tensors(hf_dir)
    return {
        ours: torch.cat([tensors[name] for name, _ in segments]).float()
        for ours, segments in hf_segments(spec).items()
    }


def _one_rank_model(spec, hf_dir: Path | None = None):
    groups = grid_position(Grid(), 0)
    model = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=3)
    stats = load_hf_weights(model, groups, hf_dir) if hf_dir is not None else None
    return model, groups, stats


def _hf_model(directory: Path, **kwargs):
    return (
        _tf()
        .AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager", dtype=torch.float32, **kwargs
        )
        .eval()
    )


BATCH = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


# --- import -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["sharded", "tied", "bf16"])
def test_one_rank_reads_every_tensor_once(hf_dirs, which):
    hf_dir = hf_dirs[which]
    spec = _spec(hf_dir)
    model, groups, stats = _one_rank_model(spec, hf_dir)
    full = _full_from_hf(hf_dir, spec)
    reference = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=3)
    load_full_state_dict(reference, groups, full)
    for (name, param), (_, want) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert param.dtype == torch.float32 and torch.equal(param, want), name
    used = {name for segments in hf_segments(spec).values() for name, _ in segments}
    tensors = _hf_tensors(hf_dir)
    assert stats.tensors == used and used <= tensors.keys()
    assert stats.bytes_read == sum(tensors[n].numel() * tensors[n].element_size() for n in used)
    for name in used:
        assert stats.bytes_by_tensor[name] == tensors[name].numel() * tensors[name].element_size()
    if which == "bf16":  # half the bytes of the fp32 model, same values once rounded
        assert stats.bytes_read * 2 == sum(t.numel() * 4 for n, t in tensors.items() if n in used)


@pytest.mark.parametrize("which", ["sharded", "tied"])
def test_imported_model_gives_transformers_logits(hf_dirs, which):
    spec = _spec(hf_dirs[which])
    model, _, _ = _one_rank_model(spec, hf_dirs[which])
    with torch.no_grad():
        ours = model(BATCH)
        theirs = _hf_model(hf_dirs[which])(BATCH).logits[:, -1]
    assert ours.shape == theirs.shape == (2, 512)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def test_missing_tensor_and_wrong_shape_are_one_line_errors(hf_dirs, tmp_path):
    from axonn_launch.common.hf import HFConfigError

    spec = _spec(hf_dirs["sharded"])
    wrong = replace(spec, ffn_hidden=96)  # down_proj has 128 columns, gate_proj 128 rows
    model, groups, _ = _one_rank_model(wrong)
    with pytest.raises(HFConfigError, match=r"gate_proj.weight has shape \[128, 64\], expected"):
        load_hf_weights(model, groups, hf_dirs["sharded"])
    untied = replace(_spec(hf_dirs["tied"]), tie_embeddings=False)
    model, groups, _ = _one_rank_model(untied)
    with pytest.raises(HFConfigError, match="no tensor 'lm_head.weight'"):
        load_hf_weights(model, groups, hf_dirs["tied"])
    with pytest.raises(HFConfigError, match="has no safetensors weights"):
        load_hf_weights(model, groups, tmp_path)


def _set(name: str, at: tuple[int, int], value: float):
    return lambda tensors: tensors[name].__setitem__(at, value)


def test_non_finite_and_integer_weights_are_refused_at_load_naming_the_tensor(hf_dirs, tmp_path):
    """The login node reads only headers; the job refuses a NaN or inf it loads (and an
    integer tensor, checked on the login node too) in one line naming the tensor."""
    import shutil

    from safetensors.torch import save_file

    from axonn_launch.common.hf import HFConfigError

    spec = _spec(hf_dirs["tied"])
    name = "model.layers.1.mlp.down_proj.weight"
    ok, floating = "valid: finite values", "valid: a floating-point dtype (F16, BF16, F32, F64)"
    cases = [
        (_set(name, (3, 5), float("nan")), f"1 NaN and 0 inf values, the first at [3, 5]; {ok}"),
        (_set(name, (0, 0), float("-inf")), f"0 NaN and 1 inf values, the first at [0, 0]; {ok}"),
        (lambda tensors: tensors.__setitem__(name, tensors[name].long()), f"I64; {floating}"),
    ]  # fmt: skip
    for change, words in cases:
        folder = tmp_path / "bad"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(hf_dirs["tied"], folder)
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        model, groups, _ = _one_rank_model(spec)
        with pytest.raises(HFConfigError) as caught:
            load_hf_weights(model, groups, folder)
        verb = "is stored as" if "I64" in words else "holds"
        assert str(caught.value) == f"{folder}: tensor {name} {verb} {words}"


def _import_worlds(rank: int, world: int, grids: list[Grid], hf_dir: str, root: str) -> dict:
    """Import on each grid; check against load_full_state_dict; report bytes read."""
    out = {}
    group = dist.new_group(backend="gloo")
    spec = _spec(Path(hf_dir))
    full = _full_from_hf(Path(hf_dir), spec)
    owner = {hf: ours for ours, segs in hf_segments(spec).items() for hf, _ in segs}
    for grid in grids:
        groups = build_groups(grid, rank=rank)
        model = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=11)
        stats = load_hf_weights(model, groups, hf_dir)
        reference = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=12)
        load_full_state_dict(reference, groups, full)
        shard_bytes, unique = 0, set()
        params = dict(model.named_parameters())
        for name, want in reference.named_parameters():
            assert torch.equal(params[name], want), (grid.describe(), rank, name)
            layout = params[name].shard_layout
            shard_bytes += sum(p.numel for p in shard_pieces(layout, groups)) * 4
            if not layout.replicated_over and getattr(layout, "y_replicas", 1) == 1:
                unique.add(name)
        out[grid.describe()] = {
            "bytes": stats.bytes_read,
            "shard_bytes": shard_bytes,
            "by_tensor": stats.bytes_by_tensor,
            "data": groups.coords.data,
            "unique": sorted(hf for hf, ours in owner.items() if ours in unique),
        }
        if grid == SAVE_GRID:
            _save(model, groups, grid, spec, Path(hf_dir), Path(root), rank, group)
        dist.barrier()
    return out


def _save(model, groups, grid, spec, hf_dir: Path, job: Path, rank: int, group) -> None:
    checkpointer = Checkpointer(job, rank=rank, keep=1, group=group)
    meta = {"grid": grid.as_dict(), "model": asdict(replace(spec, init_from=str(hf_dir)))}
    save_training_state(checkpointer, 1, model=model,
                        optimizer=build_optimizer(model, TrainConfig()),
                        loader_state={"step": 1}, rng={}, groups=groups, meta=meta)  # fmt: skip
    checkpointer.wait()


@pytest.fixture(scope="module")
def grid_runs(hf_dirs, tmp_path_factory):
    job = tmp_path_factory.mktemp("job_x2z2")
    results = run_world(_import_worlds, 4, GRIDS, str(hf_dirs["sharded"]), str(job), timeout=300)
    return results, job


def test_every_grid_gets_its_shard_and_reads_only_that(grid_runs, hf_dirs):
    results, _ = grid_runs
    sizes = {n: t.numel() * 4 for n, t in _hf_tensors(hf_dirs["sharded"]).items()}
    for grid in GRIDS:
        ranks = [result[grid.describe()] for result in results]
        for rank, got in enumerate(ranks):
            assert got["bytes"] == got["shard_bytes"], (grid.describe(), rank)
            assert sum(got["by_tensor"].values()) == got["bytes"]
            for name, nbytes in got["by_tensor"].items():
                assert nbytes <= sizes[name]
                if name in got["unique"] and grid.tensor_parallel > 1:
                    assert nbytes < sizes[name], (grid.describe(), rank, name)
        plane = [got for got in ranks if got["data"] == 0]
        unique = ranks[0]["unique"]
        assert "model.layers.0.self_attn.q_proj.weight" in unique
        for name in unique:  # the plane reads each sharded tensor exactly once
            assert sum(got["by_tensor"].get(name, 0) for got in plane) == sizes[name], name
        replicas = [got["bytes"] for got in ranks if got["data"] == 1]
        if replicas:  # each data replica reads its own shard again
            assert sum(replicas) == sum(got["bytes"] for got in plane)


@pytest.mark.parametrize("grid", [Grid(x=2, y=2, z=2), Grid(x=4, z=2), Grid(y=2, z=4)])
def test_every_rank_of_a_grid_in_one_process(hf_dirs, grid):
    """All ranks of larger grids, built one after another in this process (loading needs
    no collective): padded vocab rows are zero, and the ranks read the tensors once."""
    hf_dir = hf_dirs["odd"]
    spec = _spec(hf_dir)
    full = _full_from_hf(hf_dir, spec)
    sizes = {n: t.numel() * 4 for n, t in _hf_tensors(hf_dir).items()}
    read: dict[str, int] = {}
    for rank in range(grid.world_size):
        groups = grid_position(grid, rank)
        model = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=3)
        stats = load_hf_weights(model, groups, hf_dir)
        reference = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=4)
        load_full_state_dict(reference, groups, full)
        shard_bytes = 0
        for (name, param), (_, want) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(param, want), (rank, name)
            shard_bytes += sum(p.numel for p in shard_pieces(param.shard_layout, groups)) * 4
            if param.shard_layout.owns_copy(groups):
                for hf_name, _ in hf_segments(spec)[name]:
                    read[hf_name] = read.get(hf_name, 0) + stats.bytes_by_tensor.get(hf_name, 0)
        plane = grid.x * grid.y
        assert model.embedding.wte.shard_layout.pad_rows_to == -(-502 // plane) * plane
        assert stats.bytes_read == shard_bytes, rank
    assert read == sizes  # the owning copies together read every tensor exactly once


# --- export --------------------------------------------------------------------------


def _job_of(model, groups, spec, hf_dir: Path, job: Path) -> Path:
    """A one-rank checkpoint of ``model`` whose meta names ``hf_dir`` as init_from."""
    _save(model, groups, Grid(), spec, hf_dir, job, 0, None)
    return job


@pytest.fixture(scope="module")
def trained(hf_dirs, tmp_path_factory):
    """A one-rank checkpoint of the sharded model, every weight moved a little."""
    spec = _spec(hf_dirs["sharded"])
    model, groups, _ = _one_rank_model(spec, hf_dirs["sharded"])
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=gen))
    job = _job_of(model, groups, spec, hf_dirs["sharded"], tmp_path_factory.mktemp("trained"))
    return job, model, full_state_dict(model, groups)


def _expected_hf(full: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    out = {}
    for ours, segments in hf_segments(spec).items():
        out.update(zip([n for n, _ in segments],
                       full[ours].split([r for _, r in segments]), strict=True))  # fmt: skip
    return out


def test_export_loads_in_transformers_with_our_weights_and_logits(trained, hf_dirs, tmp_path):
    job, model, full = trained
    spec = _spec(hf_dirs["sharded"])
    out = tmp_path / "hf"
    assert main([str(job), "--hf", str(out), "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(files)
    for file in files:
        assert (out / file).stat().st_size <= 100_000 + 4096 or len(load_file(out / file)) == 1
    expected = _expected_hf(full, spec)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in expected.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dirs["sharded"] / name).read_bytes(), name
    assert not list(tmp_path.glob(".*partial"))

    hf = _hf_model(out)
    state = hf.state_dict()
    assert set(state) == set(expected) == set(index["weight_map"])
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    with torch.no_grad():
        ours, theirs = model(BATCH), hf(BATCH).logits[:, -1]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    tok = _tf().AutoTokenizer.from_pretrained(out)
    assert tok("hello world").input_ids[-2:] == [3, 4]


def test_export_of_a_four_rank_checkpoint_is_the_original_model(grid_runs, hf_dirs, tmp_path):
    _, job = grid_runs
    out = tmp_path / "hf"
    assert main([str(job), "--hf", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    original = _hf_tensors(hf_dirs["sharded"])
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name  # bit for bit
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2


def test_bf16_export(trained, hf_dirs, tmp_path):
    job, _, full = trained
    out = tmp_path / "hf"
    assert main([str(job), "--hf", str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}  # noqa: SIM118
    hf = _tf().AutoModelForCausalLM.from_pretrained(out)
    assert next(hf.parameters()).dtype == torch.bfloat16
    for name, tensor in _expected_hf(full, _spec(hf_dirs["sharded"])).items():
        assert torch.equal(hf.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_tied_llama3_model_round_trips(hf_dirs, tmp_path):
    spec = _spec(hf_dirs["tied"])
    model, groups, _ = _one_rank_model(spec, hf_dirs["tied"])
    job = _job_of(model, groups, spec, hf_dirs["tied"], tmp_path / "job")
    out = tmp_path / "hf"
    assert main([str(job), "--hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"]["factor"] == 8.0
    exported, original = _hf_model(out), _hf_model(hf_dirs["tied"])
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(exported(BATCH).logits, original(BATCH).logits)


def test_export_holds_one_of_our_tensors_at_a_time(trained, tmp_path, monkeypatch):
    job, _, _ = trained
    alive, peak = [0], [0]
    read = train_export.read_full

    def counting(path, name, md):
        tensor = read(path, name, md)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(tensor, lambda: alive.__setitem__(0, alive[0] - 1))
        return tensor

    monkeypatch.setattr(train_export, "read_full", counting)
    assert main([str(job), "--hf", str(tmp_path / "hf"), "--max-shard-size", "50KB"]) == 0
    assert peak[0] == 1 and alive[0] == 0
