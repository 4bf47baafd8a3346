"""The stages of ``bench/gpu/gpu_check.py``, run in its child process (imports torch).

Each stage fills a results dict as it goes, so a stage cut at its budget still reports
what it measured. Shapes, sources and what each field means: bench/gpu/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.checkpoint import checkpoint

from axonn_launch.calibrate import Settings
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig
from axonn_launch.config.compose import build
from axonn_launch.cost.memory import estimate_memory, fit_micro_batch
from axonn_launch.cost.perf import load_calibration, planned_gemms, profile_calibration, step_time
from axonn_launch.train.health import calibrate as measuring
from axonn_launch.train.inference.generation import CachedSteps, WindowSteps, run_steps
from axonn_launch.train.models.gpt import finish_gradients
from axonn_launch.train.models.optim import autocast, build_optimizer
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.bootstrap import DistEnv, init_distributed
from axonn_launch.train.parallel.comm import resolve_wire
from axonn_launch.train.parallel.groups import single_process_groups

# GPT-3 XL, 1.3B parameters (Brown et al. 2020, arXiv 2005.14165, Table 2.1: 24 layers,
# d_model 2048, 16 heads) with GPT-2's vocabulary padded to 50,304 as our presets pad it;
# no preset of ours is near 1.3B (gpt_small is 25M, gpt_5b is 5B).
GPT_1B3 = ModelSpec("gpt_1b3", n_layer=24, d_model=2048, n_head=16, vocab_size=50304,
                    max_seq_len=2048)  # fmt: skip
GPT_CPU = ModelSpec("gpt_cpu", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
# NVIDIA H200 SXM: 1,979 TFLOP/s bf16 with sparsity = 989 dense, 4.8 TB/s HBM3e
# (https://www.nvidia.com/en-us/data-center/h200/); the GEMM efficiency of the same GH100
# chip on an H100-SXM (github.com/zzc0721/torch-performance-test-data/issues/79, as
# conf/machine/alps.yaml). Memory: the device's own, read at run time.
H200_PEAK_TFLOPS = 989.0
H200_MEMORY_GBPS = 4800.0
FP32_REL = 1e-5  # the fp32 tolerance
BF16_REL = 2e-2  # the loss: tests/train/parallel/test_bf16_grids.py's per-step tolerance
# The gradients of one bf16 step against the fp32 reference, as one relative norm
# ||g_bf16 - g_fp32|| / ||g_fp32|| over every parameter. bf16 keeps 8 significant bits:
# unit roundoff u = 2^-8 (torch.finfo(torch.bfloat16).eps / 2). Autocast rounds every
# GEMM's operands to bf16 (fp32 accumulation and master weights), forward and backward, so
# each gradient carries a few u of independent roundings: measured on CPU autocast, 3.7e-3
# (gpt_tiny) and 3.9e-3 (llama_tiny), about 1 u. The bound is 8 u = 2^-5 = 3.1e-2: room
# for GPU kernels that round more (attention's probabilities in bf16 before P.V, fused
# kernels' bf16 outputs), while a wrong gradient (a lost scale, a missed reduction, a
# stale cast) is off by O(1).
BF16_GRAD_REL = 8 * 2.0**-8


class StageStop(RuntimeError):
    """The device is not usable: one line, the run stops."""


class StageTimeout(RuntimeError):
    """The stage ran past its budget."""


@dataclass
class Context:
    device: torch.device
    cpu: bool
    hardware: Hardware
    spec: ModelSpec
    seq: int
    steps: int  # timed steps per measurement
    out: Path = Path(".")
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)  # between stages

    @classmethod
    def make(cls, cpu: bool, out: Path) -> Context:
        if not cpu and not torch.cuda.is_available():
            raise StageStop("torch.cuda.is_available() is False: no usable GPU or driver")
        device = torch.device("cpu" if cpu else "cuda:0")
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 exactness means fp32 GEMMs
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                      master_addr="127.0.0.1", master_port=0, device=str(device),
                      backend="gloo" if cpu else "nccl", source="single")  # fmt: skip
        init_distributed(env)
        if cpu:
            return cls(device, True, Hardware(), GPT_CPU, seq=64, steps=1, out=out)
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        hw = Hardware(gpus_per_node=1, gpu_model=torch.cuda.get_device_name(device),
                      mem_per_gpu_gb=memory, peak_tflops_per_gpu=H200_PEAK_TFLOPS,
                      memory_gbps=H200_MEMORY_GBPS, gemm_efficiency=[0.806])  # fmt: skip
        return cls(device, False, hw, GPT_1B3, seq=2048, steps=8, out=out)

    def versions(self) -> dict[str, Any]:
        info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(self.device)}
        if self.cpu:
            return {**info, "name": "cpu"}
        props = torch.cuda.get_device_properties(self.device)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return {**info, "name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "nccl": nccl,
                "driver": _driver()}  # fmt: skip


def _driver() -> str:
    try:
        cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def run_stage(name: str, ctx: Context, budget_s: float, report: dict) -> dict[str, Any]:
    """Run one stage under a SIGALRM budget; its partial results survive a cut."""
    results: dict[str, Any] = {}

    def expire(signum, frame):
        raise StageTimeout(f"over its budget of {budget_s:g} s")

    began = time.perf_counter()
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(budget_s)))
    status, error = "ok", ""
    try:
        STAGE_FUNCTIONS[name](ctx, results, report)
    except StageTimeout as exc:
        status, error = "cut", str(exc)
    except Exception as exc:  # a failed stage is reported, the next one still runs
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        results["traceback"] = traceback.format_exc(limit=6)
    finally:
        signal.alarm(0)
        _free(ctx)
    seconds = time.perf_counter() - began
    return {"status": status, "seconds": seconds, "budget_s": budget_s, "results": results,
            "error": error}  # fmt: skip


def _free(ctx: Context) -> None:
    if not ctx.cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- models


def train_config(ctx: Context, micro: int, *, checkpointing: bool = True, dtype: str = "bf16"):
    return TrainConfig(
        global_batch=micro,
        micro_batch=micro,
        seq_len=ctx.seq,
        dtype=dtype,
        activation_checkpointing=checkpointing,
        gemm_tuning=not ctx.cpu,
    )  # fmt: skip  (the tuner's timing: seconds on CPU)


def compute_dtype(ctx: Context, train: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if train.dtype == "bf16" and not ctx.cpu else torch.float32


def ours(spec: ModelSpec, train: TrainConfig, device: torch.device, dtype: torch.dtype):
    wire = resolve_wire(train.wire, dtype)
    return build_model(spec, groups=single_process_groups(), overlap=train.overlap, seed=0,
                       activation_checkpointing=train.activation_checkpointing, device=device,
                       wire=wire, gemm_tuning=train.gemm_tuning)  # fmt: skip


class PlainGPT(nn.Module):
    """The peer: a GPT of the same shape in plain PyTorch with
    ``F.scaled_dot_product_attention`` (causal), tied embeddings, no tensor parallelism."""

    def __init__(self, spec: ModelSpec, checkpointing: bool, device: torch.device) -> None:
        super().__init__()
        h, self.spec, self.checkpointing = spec.d_model, spec, checkpointing
        self.wte = nn.Embedding(spec.vocab_size, h, device=device)
        self.wpe = nn.Embedding(spec.max_seq_len, h, device=device)
        self.blocks = nn.ModuleList(PlainBlock(spec, device) for _ in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(h, device=device)
        for table in (self.wte, self.wpe):
            nn.init.normal_(table.weight, std=0.02)  # GPT-2's scale (nn's default is 1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PlainBlock(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        super().__init__()
        h, self.heads = spec.d_model, spec.n_head
        self.ln1, self.ln2 = nn.LayerNorm(h, device=device), nn.LayerNorm(h, device=device)
        self.qkv, self.proj = nn.Linear(h, 3 * h, device=device), nn.Linear(h, h, device=device)
        self.up = nn.Linear(h, spec.ffn_mult * h, device=device)
        self.down = nn.Linear(spec.ffn_mult * h, h, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True)  # fmt: skip
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def batch(ctx: Context, spec: ModelSpec, micro: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (micro, ctx.seq + 1), generator=gen)
    return tokens[:, :-1].to(ctx.device), tokens[:, 1:].to(ctx.device)


def timed_steps(ctx: Context, model: nn.Module, optimizer, train, dtype, *, ours_: bool) -> dict:
    """Median seconds of ``ctx.steps`` training steps after 2 warm-up steps (the GEMM
    tuner's first steps among them), and the peak memory allocated."""
    x, y = batch(ctx, model.spec, train.micro_batch)
    times = []
    if not ctx.cpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for i in range(2 + ctx.steps):
        began = time.perf_counter()
        with autocast(ctx.device, dtype):
            loss = model(x, y)
        loss.backward()
        if ours_:
            finish_gradients(model, model.groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not ctx.cpu:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - began)
    peak = None if ctx.cpu else torch.cuda.max_memory_allocated(ctx.device)
    return {"step_s": statistics.median(times), "loss": float(loss.detach()), "max_allocated": peak}


def throughput(ctx: Context, spec: ModelSpec, train: TrainConfig, timing: dict) -> dict:
    """Tokens/s, TFLOP/s and MFU with axonn.md §5.4's count (Narayanan: 4 passes with full
    recompute, 3 without), and the 3-pass model FLOPs beside it."""
    tokens = train.micro_batch * train.seq_len / timing["step_s"]
    counted = spec.flops_per_token(train.seq_len, recompute=train.activation_checkpointing)
    model = spec.flops_per_token(train.seq_len, recompute=False)
    peak = ctx.hardware.peak_tflops_per_gpu
    out = {**timing, "tokens_per_s": tokens, "tflops": counted * tokens / 1e12}
    out["model_tflops"] = model * tokens / 1e12
    out["mfu"] = out["tflops"] / peak if peak else None
    out["mfu_model_flops"] = out["model_tflops"] / peak if peak else None
    return out


# --------------------------------------------------------------------------- stages


def stage_exactness(ctx: Context, res: dict, report: dict) -> None:
    res["note"] = ("one GPU: multi-rank NCCL cannot run; the NCCL process group at world size"
                   " 1 and the bootstrap on the device are checked, and the 4D layers through"
                   " full model steps at world size 1")  # fmt: skip
    res["process_group"] = process_group_check(ctx)
    for name in ("gpt_tiny", "llama_tiny"):
        res[name] = step_against_cpu(ctx, preset(name))
    res["kv_cache_generation"] = generation_check(ctx, preset("gpt_tiny"))


def preset(name: str) -> ModelSpec:
    """A model preset's shape, read from its file (no Hydra composition: seconds saved)."""
    path = Path(__file__).resolve().parents[2] / "axonn_launch" / "conf" / "model" / f"{name}.yaml"
    return build(ModelSpec, yaml.safe_load(path.read_text())["model"], "model")


def process_group_check(ctx: Context) -> dict:
    value = torch.ones(4, device=ctx.device)
    dist.all_reduce(value)
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "all_reduce_ok": bool((value == 1).all())}  # fmt: skip


def loss_and_grads(spec, device, dtype, x, y) -> tuple[float, torch.Tensor]:
    train = TrainConfig(seq_len=x.shape[1], gemm_tuning=False)  # the plain layouts
    model = ours(spec, train, device, torch.float32)
    with autocast(device, dtype):
        loss = model(x.to(device), y.to(device))
    loss.backward()
    finish_gradients(model, model.groups)
    grads = torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()])
    return loss.item(), grads


def step_against_cpu(ctx: Context, spec: ModelSpec) -> dict:
    """Loss and every gradient of one step on the device against CPU, fp32 and bf16."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, spec.vocab_size, (4, min(32, spec.max_seq_len) + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_loss, ref_grads = loss_and_grads(spec, torch.device("cpu"), torch.float32, x, y)
    out = {}
    for label, dtype, tol, grad_tol in (
        ("fp32", torch.float32, FP32_REL, FP32_REL),
        ("bf16", torch.bfloat16, BF16_REL, BF16_GRAD_REL),  # --cpu: CPU autocast's bf16
    ):
        loss, grads = loss_and_grads(spec, ctx.device, dtype, x, y)
        loss_rel = abs(loss - ref_loss) / abs(ref_loss)
        grad_rel = float((grads - ref_grads).norm() / ref_grads.norm())
        out[label] = {"loss_rel": loss_rel, "grad_rel": grad_rel, "tolerance": tol,
                      "grad_tolerance": grad_tol,
                      "ok": loss_rel <= tol and grad_rel <= grad_tol}  # fmt: skip
    return out


def generation_check(ctx: Context, spec: ModelSpec) -> dict:
    """Greedy tokens with the KV cache equal those recomputed without it."""
    model = ours(
        spec, TrainConfig(seq_len=spec.max_seq_len, gemm_tuning=False), ctx.device, torch.float32
    )
    prompts, new = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]], 12
    pick = lambda logits: logits.argmax(dim=-1)  # noqa: E731
    kw = dict(device=ctx.device, dtype=torch.float32, pick=pick)
    cached = run_steps(model, CachedSteps(model, prompts, new, ctx.device), new, **kw)
    window = WindowSteps(model, prompts, len(prompts[0]) + new, ctx.device, None)
    plain = run_steps(model, window, new, **kw)
    return {"tokens": new, "equal": cached == plain}


def planned_micro(ctx: Context, train: TrainConfig) -> int:
    """The planner's micro-batch for one GPU (``fit_micro_batch``: the largest that fits)."""
    if ctx.cpu:
        return 4
    auto = dataclasses.replace(train, micro_batch=None, global_batch=256)
    chosen = fit_micro_batch(ctx.spec, Grid(), auto, ctx.hardware)
    if isinstance(chosen, str):
        raise RuntimeError(f"the planner fits no micro-batch: {chosen}")
    return chosen[0]


def stage_mfu(ctx: Context, res: dict, report: dict) -> None:
    micro = planned_micro(ctx, train_config(ctx, 1))
    train = train_config(ctx, micro)
    dtype = compute_dtype(ctx, train)
    res.update(model=ctx.spec.name, params=ctx.spec.n_params(), micro_batch=micro,
               seq_len=ctx.seq, dtype=str(dtype), activation_checkpointing=True,
               peak_tflops=ctx.hardware.peak_tflops_per_gpu or None)  # fmt: skip
    model = ours(ctx.spec, train, ctx.device, dtype)
    res["ours"] = throughput(ctx, ctx.spec, train, timed_steps(
        ctx, model, build_optimizer(model, train), train, dtype, ours_=True))  # fmt: skip
    del model
    _free(ctx)
    peer = PlainGPT(ctx.spec, True, ctx.device)
    optimizer = torch.optim.AdamW(peer.parameters(), lr=train.lr, betas=(0.9, 0.95))
    res["sdpa_peer"] = throughput(ctx, ctx.spec, train, timed_steps(
        ctx, peer, optimizer, train, dtype, ours_=False))  # fmt: skip
    res["ours_over_peer"] = res["sdpa_peer"]["step_s"] / res["ours"]["step_s"]
    ctx.shared["mfu"] = {"train": train, "step_s": res["ours"]["step_s"]}


def stage_memory(ctx: Context, res: dict, report: dict) -> None:
    micro = ctx.shared.get("mfu", {}).get("train", train_config(ctx, 4)).micro_batch
    settings = [(micro, True), (max(1, micro // 2), True), (max(1, micro // 8), False)]
    for m, ckpt in settings:
        train = train_config(ctx, m, checkpointing=ckpt)
        estimate = estimate_memory(model=ctx.spec, grid=Grid(), train=train, on_gpu=not ctx.cpu)
        row = {"micro_batch": m, "activation_checkpointing": ckpt, "estimate": estimate.total}
        res[f"mb{m}_ckpt{int(ckpt)}"] = row
        dtype = compute_dtype(ctx, train)
        model = ours(ctx.spec, train, ctx.device, dtype)
        try:
            timing = timed_steps(
                ctx, model, build_optimizer(model, train), train, dtype, ours_=True
            )
            row["measured"] = timing["max_allocated"]
        except torch.OutOfMemoryError:
            row["measured"] = "out of memory"
        measured = row["measured"]
        row["ratio"] = measured / estimate.total if isinstance(measured, int) else None
        del model
        _free(ctx)


def stage_planner(ctx: Context, res: dict, report: dict) -> None:
    train = ctx.shared.get("mfu", {}).get("train", train_config(ctx, 4))
    settings = Settings(machine="h200" if not ctx.cpu else "local", reps=3, warmup=1,
                        block_seconds=0.005 if ctx.cpu else 0.03)  # fmt: skip
    shapes = planned_gemms(ctx.spec, Grid(), train)
    measured = {"machine": settings.machine, "world_size": 1, "gpus_per_node": 1,
                "device": ctx.device.type, "torch": torch.__version__,
                "gemm": measuring.measure_gemm(ctx.device, settings),
                "elementwise": measuring.measure_elementwise(ctx.device, settings)}  # fmt: skip
    measured["gemm_shapes"] = measuring.measure_gemm_shapes(shapes, ctx.device, settings)
    path = ctx.out / f"calibration-{'cpu' if ctx.cpu else 'h200'}.json"
    path.write_text(json.dumps(measured, indent=2))
    res["calibration_file"] = str(path)
    res["layouts"] = [{"op": g["op"], "linear": g["linear"], "best": g["best"],
                       "best_over_direct": max(g["tflops"].values()) / g["tflops"]["direct"]}
                      for g in measured["gemm_shapes"]]  # fmt: skip
    cal = load_calibration(path, profile_calibration(ctx.hardware))
    kw = dict(hardware=ctx.hardware, model=ctx.spec, train=train, grid=Grid())
    plain, calibrated = step_time(**kw).total, step_time(**kw, calibration=cal).total
    step = ctx.shared.get("mfu", {}).get("step_s")
    res.update(predicted_s=plain, predicted_calibrated_s=calibrated, measured_s=step)
    res["ratio"] = plain / step if step else None
    res["ratio_calibrated"] = calibrated / step if step else None


def stage_pieces(ctx: Context, res: dict, report: dict) -> None:
    """bf16 vs fp32 and checkpointing on vs off, on 8 of the 1.3B's 24 blocks (the same
    widths, a third of the time); weight caching does not apply on one GPU."""
    spec = dataclasses.replace(ctx.spec, n_layer=min(8, ctx.spec.n_layer))
    micro = max(1, ctx.shared.get("mfu", {}).get("train", train_config(ctx, 4)).micro_batch // 2)
    res["weight_caching"] = "not applicable: z = 1 on one GPU, no weights are gathered"
    for label, ckpt, dtype_name in (("bf16_ckpt", True, "bf16"), ("bf16_no_ckpt", False, "bf16"),
                                    ("fp32_ckpt", True, "fp32")):  # fmt: skip
        train = train_config(ctx, micro, checkpointing=ckpt, dtype=dtype_name)
        dtype = compute_dtype(ctx, train)
        model = ours(spec, train, ctx.device, dtype)
        timing = timed_steps(ctx, model, build_optimizer(model, train), train, dtype, ours_=True)
        res[label] = throughput(ctx, spec, train, timing)
        del model
        _free(ctx)


STAGE_FUNCTIONS = {
    "exactness": stage_exactness,
    "mfu": stage_mfu,
    "memory": stage_memory,
    "planner": stage_planner,
    "pieces": stage_pieces,
}
