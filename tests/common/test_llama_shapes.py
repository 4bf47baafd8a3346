"""The Llama architecture on the login node: counts, FLOPs, shape rules, memory, traffic and
planning, each checked against hand values or the job's own layers (``train/models/llama.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from axonn_launch.common import rules
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.common.traffic import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    block_linears,
    block_volumes,
    replicated_kv_elements,
    wire_bytes,
)
from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import resolve
from axonn_launch.cost.jobcost import checkpoint_chunks
from axonn_launch.cost.memory import (
    GIB,
    estimate_memory,
    layer_activation_bytes,
    local_param_elements,
    replicated_over_z_elements,
)
from axonn_launch.cost.perf import Calibration, _Costs, _gradient_sync, step_time
from axonn_launch.plan import main as plan_main
from axonn_launch.submit.pipeline import batch_script

CONF = Path(__file__).resolve().parents[2] / "axonn_launch" / "conf" / "model"
LLAMA_PRESETS = ("llama_tiny", "tinyllama_1b", "llama3_8b", "llama3_70b", "llama3_405b")
GPT_PRESETS = sorted(p.stem for p in CONF.glob("gpt_*.yaml"))
CLUSTERS = ("perlmutter", "frontier", "alps")

# h=64, 4 query heads of 16, 2 KV heads, SwiGLU of 96 units, untied head
TINY = ModelSpec("t", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=32,
                 arch="llama", n_kv_head=2, ffn_hidden=96, tie_embeddings=False)  # fmt: skip


def model(name: str) -> ModelSpec:
    return load([f"model={name}"]).model


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    "name,billions",
    [("tinyllama_1b", 1.1), ("llama3_8b", 8.03), ("llama3_70b", 70.6), ("llama3_405b", 405.9)],
)
def test_presets_have_the_model_cards_parameter_counts(name, billions):
    assert model(name).n_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_llama_count_by_hand():
    # q 64*64, kv 2*2*16*64, proj 64*64, gate_up 64*192, down 96*64, two norms; tables, norm
    per_layer = 4096 + 4096 + 4096 + 12288 + 6144 + 2 * 64
    assert TINY.n_params() == 2 * per_layer + 2 * 256 * 64 + 64
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert TINY.n_params() - tied.n_params() == 256 * 64


def test_a_llama_preset_takes_overrides_of_every_llama_key():
    cfg = load(["model=llama3_8b", "model.n_kv_head=4", "model.tie_embeddings=true",
                "model.rope_scaling_factor=0", "model.ffn_hidden=8192"])  # fmt: skip
    m = cfg.model
    assert (m.arch, m.kv_heads, m.tie_embeddings, m.d_ff) == ("llama", 4, True, 8192)


# --------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name", GPT_PRESETS)
@pytest.mark.parametrize("recompute", [True, False])
def test_the_general_flops_formula_is_narayanans_for_gpt(name, recompute):
    m = model(name)
    l, h, v, s = m.n_layer, m.d_model, m.vocab_size, 2048
    if recompute:
        narayanan = 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    else:
        narayanan = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert m.flops_per_token(s, recompute=recompute) == pytest.approx(narayanan, rel=1e-12)


def test_llama_flops_by_hand():
    # 3 passes without recompute: 2 FLOPs per weight per token, 4*s*h attention, 6Vh head
    linear = 4096 + 4096 + 4096 + 12288 + 6144
    expected = 3 * 2 * (2 * linear + 4 * 32 * 64) + 6 * 256 * 64
    assert TINY.flops_per_token(32, recompute=False) == expected
    assert TINY.flops_per_token(32, recompute=True) == expected + 2 * (2 * linear + 4 * 32 * 64)


# --------------------------------------------------------------------------- rules


KV4 = ModelSpec("kv4", n_layer=1, d_model=96, n_head=12, vocab_size=64, max_seq_len=8,
                arch="llama", n_kv_head=4, ffn_hidden=96)  # fmt: skip


def test_kv_heads_must_split_over_y_or_y_over_them():
    assert rules.shape_problem(KV4, Grid(y=2)) is None  # 2 KV heads per y rank
    assert rules.shape_problem(KV4, Grid(y=12)) is None  # each KV head on 3 y ranks
    assert rules.shape_problem(KV4, Grid(y=6)) == (
        "grid.y=6: must divide model.n_kv_head=4 (KV heads split over y) or be a multiple of"
        " it (each y rank holds the one KV head its query heads use); valid y: 1, 2, 4, 12"
    )
    assert rules.shape_problem(KV4, Grid(y=8)).startswith(
        "grid.y=8: must divide model.n_head=12 (heads are split over y); valid y: 1, 2, 4, 12"
    )


def test_model_rules_name_the_field_and_the_valid_values():
    bad_kv = dataclasses.replace(KV4, n_kv_head=5)
    assert rules.model_problem(bad_kv) == (
        "model.n_kv_head=5: must divide model.n_head=12 (each KV head serves a group of query"
        " heads); valid n_kv_head: 1, 2, 3, 4, 6, 12"
    )
    odd = dataclasses.replace(KV4, d_model=36, n_kv_head=0)
    assert rules.model_problem(odd) == (
        "model.n_head=12: the head dimension model.d_model/model.n_head=3 must be even (rotary"
        " positions turn pairs of features); valid n_head: 1, 2, 3, 6, 9, 18"
    )
    gpt = ModelSpec("g", n_layer=1, d_model=64, n_head=4, vocab_size=64, max_seq_len=8,
                    n_kv_head=2)  # fmt: skip
    assert rules.model_problem(gpt) == (
        "model.n_kv_head=2: grouped-query attention needs model.arch=llama; valid for"
        " arch=gpt: 0 or model.n_head=4"
    )


def test_the_mlp_width_is_split_over_y():
    narrow = dataclasses.replace(KV4, ffn_hidden=100)
    assert rules.shape_problem(narrow, Grid(y=4)) is None
    assert rules.shape_problem(narrow, Grid(y=12)) == (
        "grid.y=12: must divide the MLP width 100 (model.ffn_hidden, or model.ffn_mult*"
        "model.d_model; its units are split over y); valid y: 1, 2, 4"
    )


def test_a_replicated_kv_block_must_split_over_z():
    # y=12 > 4 KV heads: each y rank's KV block is one head's k and v rows, [2*8, 96]
    blocks = rules.z_blocks(KV4, Grid(y=12))
    assert blocks["key-value weight block"] == 2 * 8 * 96
    assert blocks["query weight block"] == 8 * 96
    problem = rules.shape_problem(KV4, Grid(y=12, z=512))
    assert problem.startswith("grid.z=512: must divide the query weight block of 768 elements")


def layers_build(spec: ModelSpec, grid: Grid) -> str | None:
    """The job's Llama layers for the grid's last rank on the meta device, or their error."""
    from axonn_launch.train.models.llama import LlamaBlock
    from axonn_launch.train.parallel.attention import rope_frequencies
    from axonn_launch.train.parallel.comm import Comm
    from axonn_launch.train.parallel.layers import OverlapRuntime, TPRMSNorm, VocabParallelEmbedding
    from axonn_launch.train.parallel.shards import grid_position

    comm = Comm(grid_position(grid, grid.world_size - 1))
    runtime = OverlapRuntime(comm, OverlapConfig())
    try:
        emb = VocabParallelEmbedding(spec.vocab_size, spec.max_seq_len, spec.d_model, comm=comm,
                                     device="meta", positions=False,
                                     tied=spec.tie_embeddings)  # fmt: skip
        block = LlamaBlock(spec, comm=comm, runtime=runtime, name="blocks.0", device="meta",
                           layer=0, inv_freq=rope_frequencies(spec))  # fmt: skip
        norm = TPRMSNorm(spec.d_model, comm=comm, name="ln_f", device="meta")
    except ValueError as exc:
        return str(exc)
    return emb, block, norm


@pytest.mark.parametrize(
    "spec",
    [TINY, KV4, dataclasses.replace(KV4, n_kv_head=1, ffn_hidden=120, vocab_size=50)],
    ids=["kv2", "kv4", "kv1"],
)
def test_the_rules_accept_exactly_the_grids_the_llama_layers_build_on(spec):
    checked = 0
    for x, y, z in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 12), (1, 2, 4, 8, 64)):
        grid = Grid(x=x, y=y, z=z)
        built = layers_build(spec, grid)
        rule = rules.shape_problem(spec, grid)
        assert (rule is None) == (not isinstance(built, str)), (grid, rule, built)
        checked += rule is None
    assert checked > 10


@pytest.mark.parametrize(
    "grid", [Grid(), Grid(x=2, y=2, z=2), Grid(y=4, z=2), Grid(x=4, y=4, z=4)],
    ids=lambda g: g.describe(),
)  # fmt: skip
def test_local_parameters_match_the_llama_layers(grid):
    """y=4 > 2 KV heads: every y rank holds one whole KV head (replicated over 2 ranks)."""
    emb, block, norm = layers_build(TINY, grid)
    params = [*emb.parameters(), *norm.parameters()] + TINY.n_layer * [*block.parameters()]
    assert sum(p.numel() for p in params) == local_param_elements(TINY, grid)
    over_z = sum(p.numel() for p in params if "z" in p.shard_layout.replicated_over)
    assert over_z == replicated_over_z_elements(TINY, grid)
    kv = sum(p.numel() for p in block.parameters() if p.shard_layout.y_replicas > 1)
    assert kv == replicated_kv_elements(TINY, grid) / grid.z


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_activation_formula_matches_the_saved_tensors_of_a_llama_block(bf16):
    import torch

    from axonn_launch.train.models.llama import Llama
    from axonn_launch.train.parallel.attention import Positions
    from axonn_launch.train.parallel.groups import build_groups

    llama = Llama(TINY, groups=build_groups(Grid(), rank=0), overlap=OverlapConfig())
    params = {p.untyped_storage().data_ptr() for p in llama.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hidden = torch.randn(4, 32, TINY.d_model, requires_grad=True)
    llama.runtime.begin_micro_step(training=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        llama.blocks[0](hidden, Positions())
    llama.runtime.drop_prefetched()
    assert sum(storages.values()) == layer_activation_bytes(TINY, Grid(), 4 * 32, 2 if bf16 else 4)


# --------------------------------------------------------------------------- traffic


def test_llama_block_traffic_by_hand():
    """x=2, y=4, z=2, fp32, no recompute. y=4 > 2 KV heads: the KV block is [2*16, 32].
    Forward all-reduces over x (inner of q, kv, gate_up): T*(16 + 32 + 48); over y (inner
    of proj, down): T*(32 + 32). Backward dX over y: T*32 * 3, over x: T*(16 + 24).
    RMSNorm: one number per token each way and norm. z: each block gathered forward and
    backward, reduce-scattered once."""
    tr = TrainConfig(global_batch=8, micro_batch=4, seq_len=32, dtype="fp32")
    t = 4 / 2 * 32
    blocks = 16 * 32 + 32 * 32 + 32 * 16 + 48 * 32 + 32 * 24
    assert block_volumes(TINY, Grid(x=2, y=4, z=2), tr, on_gpu=False) == {
        (ALL_REDUCE, "x", 4): t * (16 + 32 + 48) + t * (16 + 24) + 4 * t,
        (ALL_REDUCE, "y", 4): t * (32 + 32) + 3 * t * 32,
        (ALL_GATHER, "z", 4): 2 * blocks,
        (REDUCE_SCATTER, "z", 4): blocks,
    }


def test_replicated_kv_gradients_are_summed_once_per_step():
    tr = TrainConfig(global_batch=8, micro_batch=4, seq_len=32, dtype="fp32")
    hw = load(["machine=frontier"]).machine.hardware
    wire = wire_bytes(tr, on_gpu=True)

    def sync_y(grid: Grid) -> float:
        costs = _Costs(hw, grid, Calibration(), tuned=False)
        return _gradient_sync(costs, TINY, grid, wire).raw["y"]

    assert replicated_kv_elements(TINY, Grid(y=2)) == 0 and sync_y(Grid(y=2)) == 0
    assert replicated_kv_elements(TINY, Grid(y=4, z=2)) == 2 * 16 * 64
    # 2 layers of the 1/z shard, fp32, over pairs of y ranks: ring all-reduce of p=2
    nbytes = 2 * 2 * 16 * 64 / 2 * 4
    alpha = hw.latency_us * 1e-6
    expected = 2 * alpha + nbytes / (hw.intra_node_gbps * 1e9)
    assert sync_y(Grid(y=4, z=2)) == pytest.approx(expected)
    st = step_time(hardware=hw, model=TINY, train=tr, grid=Grid(y=4, z=2))
    assert st.comm_raw["y"] > 0 and st.total > 0


def test_untied_head_doubles_the_vocab_tables():
    tr = TrainConfig(global_batch=8, micro_batch=4, seq_len=32)
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    a = estimate_memory(model=TINY, grid=Grid(z=2), train=tr).terms["embedding buffers"]
    b = estimate_memory(model=tied, grid=Grid(z=2), train=tr).terms["embedding buffers"]
    assert a == 2 * b
    assert local_param_elements(TINY, Grid(z=2)) - local_param_elements(tied, Grid(z=2)) == (
        256 * 64 / 2
    )


def test_checkpoint_chunks_count_the_llama_runs():
    # x=y=z=1: one box per tensor: per layer 5 Linears (kv and gate_up in 2 runs) + 2 norms,
    # plus two tables and the final norm; times three (parameter and two moments)
    assert checkpoint_chunks(TINY, Grid()) == 3 * (2 * (7 + 2) + 2 + 1)
    assert len(block_linears(TINY)) == 5


# --------------------------------------------------------------------------- plan, dry run


@pytest.mark.parametrize("name", LLAMA_PRESETS)
@pytest.mark.parametrize("machine", CLUSTERS)
def test_every_llama_preset_plans_and_dry_runs(machine, name, tmp_path):
    cfg = load([f"machine={machine}", f"model={name}", "dry_run=true",
                f"site.accounts.{machine}=X"])  # fmt: skip
    resolved = resolve(cfg)
    grid, m = resolved.grid, cfg.model
    assert resolved.planned and rules.shape_problem(m, grid) is None
    assert resolved.memory.total <= cfg.machine.hardware.mem_per_gpu_gb * GIB
    script = batch_script(cfg, resolved, tmp_path)
    assert f"#SBATCH --nodes={resolved.nodes}\n" in script
    assert re.search(r"^srun .* -m submitit.core._submit ", script, flags=re.M)


def test_frontier_plans_llama3_405b(capsys):
    assert plan_main(["machine=frontier", "model=llama3_405b", "top=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    nodes = int(re.search(r"nodes=(\d+)", lines[0]).group(1))
    assert lines[1].startswith(f"llama3_405b on {nodes} node(s) of frontier = {8 * nodes} GPUs")
    best = lines[4].split()
    assert int(best[0]) == 1 and float(best[7]) <= 64  # mem GiB fits a 64 GiB MI250X GCD
    # 405.9B parameters need 16 bytes each of training state across the GPUs
    assert 8 * nodes * 64 * GIB >= 16 * model("llama3_405b").n_params()


def test_a_bad_kv_grid_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^grid.y=6: must divide model.n_kv_head=4 "):
        resolve(load(["model=llama_tiny", "model.d_model=96", "model.n_head=12",
                      "model.n_kv_head=4", "grid.y=6", "dry_run=true"]))  # fmt: skip
