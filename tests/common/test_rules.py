"""The rules agree: the login node accepts exactly what the job can build and run.

For every model preset (plus odd vocab sizes and small custom shapes) and every grid of up
to 64 ranks, the launcher's verdict (``resolve.resolve`` with memory unbounded) is
compared with what the job side does with that configuration: build the layers of one
rank (the last, every coordinate at its largest) with the constructors ``GPT`` calls, on
the meta device, with a ``Groups`` that has the grid's coordinates and no process groups.
Small models also run a forward and backward pass for real on one rank. Batch and
sequence rules are checked against the job's loader and embedding.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
import yaml

from axonn_launch.common import rules
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware, MachineProfile, SlurmSettings
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.config.compose import ConfigError, GridRequest, LaunchConfig
from axonn_launch.config.resolve import resolve
from axonn_launch.train.data import Geometry, Loader, SyntheticSource
from axonn_launch.train.models.gpt import GPT, Block
from axonn_launch.train.parallel.comm import Comm
from axonn_launch.train.parallel.groups import single_process_groups
from axonn_launch.train.parallel.layers import OverlapRuntime, TPLayerNorm, VocabParallelEmbedding
from axonn_launch.train.parallel.shards import grid_position

CONF = Path(__file__).resolve().parents[2] / "axonn_launch" / "conf" / "model"
MAX_RANKS = 64


def preset(path: Path) -> ModelSpec:
    return ModelSpec(**yaml.safe_load(path.read_text())["model"])


# GPT presets (Llama's rules are checked against its layers in tests/common/test_llama_shapes.py;
# model=hf has no shape until its config.json is read)
PRESETS = [m for m in map(preset, sorted(CONF.glob("*.yaml"))) if m.arch == "gpt" and m.n_layer]
GPT_TINY = next(m for m in PRESETS if m.name == "gpt_tiny")
ODD_VOCABS = [
    dataclasses.replace(m, name=f"{m.name}-v{v}", vocab_size=v)
    for m in PRESETS
    if m.name in ("gpt_tiny", "gpt_small", "gpt_5b")
    for v in (65, 50257, 131073)
]
CUSTOM = [
    ModelSpec("h24", n_layer=1, d_model=24, n_head=6, vocab_size=50, max_seq_len=8),
    ModelSpec("h24-mlp3", n_layer=1, d_model=24, n_head=3, vocab_size=7, max_seq_len=8, ffn_mult=3),
    ModelSpec("h20", n_layer=1, d_model=20, n_head=5, vocab_size=33, max_seq_len=8, ffn_mult=2),
    ModelSpec("h36", n_layer=1, d_model=36, n_head=12, vocab_size=1001, max_seq_len=8),
    ModelSpec("h2", n_layer=1, d_model=2, n_head=2, vocab_size=3, max_seq_len=8),
]
MODELS = PRESETS + ODD_VOCABS + CUSTOM
# not whole heads (d_model % n_head): only a forward pass finds out, on one rank
PARTIAL_HEADS = ModelSpec("h24-heads5", n_layer=1, d_model=24, n_head=5, vocab_size=64,
                          max_seq_len=8)  # fmt: skip

UNBOUNDED = MachineProfile(
    name="rules",
    scheduler="local",
    backend="gloo",
    hardware=Hardware(gpus_per_node=1, mem_per_gpu_gb=0),  # the memory rule is not compared
    slurm=SlurmSettings(),
    max_local_processes=MAX_RANKS,
)


def tensor_grids() -> list[tuple[int, int, int]]:
    return [
        (x, y, z)
        for x, y, z in itertools.product(range(1, MAX_RANKS + 1), repeat=3)
        if x * y * z <= MAX_RANKS
    ]


def login_accepts(model: ModelSpec, grid: Grid, train: TrainConfig) -> str | None:
    """None if the launcher accepts the configuration, else its one-line error."""
    cfg = LaunchConfig(
        name="rules",
        machine=UNBOUNDED,
        model=model,
        grid=GridRequest(**grid.as_dict()),
        train=train,
        dry_run=True,
    )
    try:
        resolve(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def shapes_train(model: ModelSpec, grid: Grid) -> TrainConfig:
    """A batch and sequence that every grid can take, so that only the shapes decide."""
    return TrainConfig(
        global_batch=2 * grid.data * grid.z, seq_len=min(8, model.max_seq_len), data="synthetic"
    )


def job_builds(model: ModelSpec, grid: Grid) -> str | None:
    """None if the job side builds the model's layers for the grid's last rank, else its
    error: the constructors ``GPT`` calls, on the meta device (shapes only, no init)."""
    comm = Comm(grid_position(grid, grid.world_size - 1))
    runtime = OverlapRuntime(comm, OverlapConfig())
    h = model.d_model
    try:
        VocabParallelEmbedding(model.vocab_size, model.max_seq_len, h, comm=comm, device="meta")
        Block(model, comm=comm, runtime=runtime, name="blocks.0", device="meta")
        TPLayerNorm(h, comm=comm, name="ln_f", device="meta")
    except ValueError as exc:
        return str(exc)
    return None


def job_runs_on_one_rank(model: ModelSpec) -> str | None:
    """Build the whole (one-layer) model on CPU and run a forward and backward pass."""
    one_layer = dataclasses.replace(model, n_layer=1)
    try:
        gpt = GPT(one_layer, groups=single_process_groups(), overlap=OverlapConfig())
        tokens = torch.randint(0, model.vocab_size, (2, min(8, model.max_seq_len) + 1))
        gpt(tokens[:, :-1], tokens[:, 1:]).backward()
    except (ValueError, RuntimeError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _elements(model: ModelSpec) -> int:
    return dataclasses.replace(model, n_layer=1).n_params()


@pytest.fixture(autouse=True)
def one_thread():
    """Meta tensors cost only Python time; more threads just contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_login_node_accepts_exactly_the_grids_the_job_can_build(model):
    grids = tensor_grids()
    checked, built = 0, 0
    for x, y, z in grids:
        job = job_builds(model, Grid(x=x, y=y, z=z))
        built += job is None
        for data in (1, 2):
            if data * x * y * z > MAX_RANKS:
                continue
            grid = Grid(data=data, x=x, y=y, z=z)
            login = login_accepts(model, grid, shapes_train(model, grid))
            assert (login is None) == (job is None), (
                f"{model} on {grid.describe()}: login node says {login or 'ok'},"
                f" job side says {job or 'ok'}"
            )
            checked += 1
    assert checked > len(grids)  # both data sizes ran
    assert 0 < built < len(grids)  # the model builds on some grids and not on others


@pytest.mark.parametrize("model", [m for m in MODELS if _elements(m) <= 100_000] + [PARTIAL_HEADS],
                         ids=lambda m: m.name)  # fmt: skip
def test_a_model_the_login_node_accepts_runs_a_training_step(model):
    login = login_accepts(model, Grid(), shapes_train(model, Grid()))
    job = job_runs_on_one_rank(model)
    assert (login is None) == (job is None), f"login: {login or 'ok'}; job: {job or 'ok'}"


def test_the_issues_example_is_rejected_with_the_token_table_rule():
    """machine=perlmutter model.vocab_size=65 grid.z=128: 65 rows of 64 over z=128."""
    model = dataclasses.replace(GPT_TINY, vocab_size=65)
    assert model.name == "gpt_tiny"
    grid = Grid(z=128)
    problem = rules.shape_problem(model, grid)
    assert problem.startswith("grid.z=128: must divide the token table block of 4160 elements")
    assert "valid z: 1, 2, 4, 8, 16, 32, 64" in problem
    assert "token table block=4160 is not divisible by 128" in job_builds(model, grid)


def test_vocab_padding_is_the_embeddings():
    for vocab, (x, y) in itertools.product((1, 7, 65, 256, 50257), ((1, 1), (2, 3), (4, 4))):
        grid = Grid(x=x, y=y)
        embedding = VocabParallelEmbedding(
            vocab, 8, 12, comm=Comm(grid_position(grid, 0)), device="meta"
        )
        assert rules.padded_vocab(vocab, grid) == embedding.padded_vocab
        assert rules.local_vocab(vocab, grid) == embedding.local_vocab


# ---------------------------------------------------------------------------------------
# Batch and sequence rules against the job's loader and embedding

TINY = GPT_TINY
H48 = ModelSpec("h48", n_layer=1, d_model=48, n_head=4, vocab_size=256, max_seq_len=64)  # z=3 too


def loader_covers_the_step(grid: Grid, train: TrainConfig) -> bool:
    """The job's loaders of all ranks read each of the step's global_batch sequences once
    per x*y plane (and no others)."""
    try:
        accumulation = train.accumulation_steps(grid)
        loaders = [
            Loader(
                SyntheticSource(vocab_size=256),
                Geometry(grid, grid.coords(rank), train.micro_batch, 8, accumulation),
                seed=0,
            )
            for rank in range(grid.world_size)
        ]
    except ValueError:
        return False
    read = sorted(
        n for ld in loaders for m in range(accumulation) for n in ld.sequence_numbers(0, m)
    )
    return accumulation >= 1 and read == sorted(list(range(train.global_batch)) * grid.x * grid.y)


BATCH_GRIDS = [
    Grid(data=d, z=z) for d in (1, 2, 3, 4) for z in (1, 2, 3, 4, 8) if d * z <= MAX_RANKS
]


@pytest.mark.parametrize("grid", BATCH_GRIDS, ids=Grid.describe)
def test_login_node_accepts_exactly_the_batches_the_loader_covers(grid):
    for global_batch in (1, 6, 8, 12, 16, 24):
        for micro in range(1, global_batch + 1):
            train = TrainConfig(global_batch=global_batch, micro_batch=micro, data="synthetic")
            login = login_accepts(H48, grid, train)
            job = loader_covers_the_step(grid, train)
            assert (login is None) == job, f"{grid.describe()} {global_batch}/{micro}: {login}"


@pytest.mark.parametrize("grid", BATCH_GRIDS, ids=Grid.describe)
def test_an_automatic_micro_batch_is_the_largest_the_loader_can_take(grid):
    for global_batch in (1, 6, 8, 12, 16, 24):
        train = TrainConfig(global_batch=global_batch, data="synthetic")
        covered = [
            m
            for m in range(1, global_batch + 1)
            if loader_covers_the_step(grid, dataclasses.replace(train, micro_batch=m))
        ]
        cfg = LaunchConfig("rules", UNBOUNDED, H48, GridRequest(**grid.as_dict()), train)
        if not covered:
            with pytest.raises(ConfigError, match="train.global_batch"):
                resolve(cfg)
            continue
        assert resolve(cfg).train.micro_batch == max(covered)


def test_sequence_length_rule_is_the_position_tables():
    embedding = VocabParallelEmbedding(256, 16, 8, comm=Comm(single_process_groups()))
    table = embedding.token_table()
    for seq_len in (1, 15, 16, 17, 64):
        train = TrainConfig(global_batch=4, seq_len=seq_len, data="synthetic")
        model = dataclasses.replace(TINY, max_seq_len=16)
        login = login_accepts(model, Grid(), train)
        try:
            embedding.embed(torch.zeros(1, seq_len, dtype=torch.long), table)
            job = None
        except RuntimeError as exc:
            job = str(exc)
        assert (login is None) == (job is None), f"seq_len={seq_len}: {login}; {job}"
        if login:
            assert login == f"train.seq_len={seq_len}: must be <= model.max_seq_len=16"


# ---------------------------------------------------------------------------------------
# The job checks the same rules before it builds anything


def test_the_job_refuses_what_the_login_node_refuses():
    from axonn_launch.common.spec import JobSpec, RuntimeConfig
    from axonn_launch.train.run import recheck_rules

    model = dataclasses.replace(TINY, vocab_size=65)
    spec = JobSpec(
        name="rules",
        job_dir="/nonexistent",
        model=model,
        grid=Grid(z=128),
        train=TrainConfig(global_batch=128, micro_batch=128, data="synthetic"),
        runtime=RuntimeConfig(),
    )
    with pytest.raises(ValueError) as job:
        recheck_rules(spec)
    assert str(job.value) == login_accepts(model, spec.grid, spec.train)
