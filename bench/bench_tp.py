"""Step time and per-rank memory: one rank, PyTorch tensor parallelism, and AxoNN grids.

Runs one GPT (default: 4 layers, h=512, 8 heads, s=128, vocab 8192, 8 sequences per
step) with a full training step (forward, backward, gradient sync, clipping, AdamW) as

  (a) the model on 1 rank;
  (b) PyTorch's own tensor parallelism (``torch.distributed.tensor.parallel``,
      Megatron-style ColwiseParallel for q/k/v/MLP-up and RowwiseParallel for
      attention-out/MLP-down on a 1-D DeviceMesh; embeddings and norms replicated);
  (c) ``axonn_launch.train.models.gpt.GPT`` on the grids x=2,y=2 / x=4 / y=4 / z=4 (overlaps
      on); y=4 is the layout of (b): heads and MLP units split, Linears' all-reduces of
      T*h; x=4 splits the hidden dim instead and all-reduces 3x as much (tp_findings.md).

All multi-rank runs use gloo on CPU with one thread per rank. Memory is the bytes of the
rank's parameters + gradients + AdamW state after a step (the target is full/(x*y*z))
and the process's peak RSS (which includes the PyTorch runtime itself).

  python bench/bench_tp.py [--steps 5] [--rounds 2] [--layers 4] [--hidden 512] [--seq 128]

``--profile`` instead measures where each rank-0 step goes without trusting wall-clock
on a shared machine: the share of torch.profiler self CPU time per kind of op (GEMM,
attention, collectives, copies, element-wise, optimizer), the top ops, and the number of
collectives per step and their elements (ours: from the ``Comm`` recorder; PyTorch TP:
the c10d ops in the profile), for PyTorch TP and the grids x=4, y=4 and x=2,y=2.
It writes ``bench/results/tp_profile.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.common.grid import Grid  # noqa: E402
from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.common.spec import OverlapConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_tp.md"
PROFILE_RESULTS = Path(__file__).resolve().parent / "results" / "tp_profile.md"
LR, MAX_NORM = 1e-3, 1.0


# ---------------------------------------------------------------------------------------
# A plain GPT with separate q/k/v projections, so that column-parallel q/k/v hand each
# rank whole heads (PyTorch TP peer)


class PlainBlock(nn.Module):
    def __init__(self, h: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = h // n_head
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (lin(x) for lin in (self.q, self.k, self.v))
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallelism
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.max_seq_len, spec.d_model)
        self.blocks = nn.ModuleList(
            PlainBlock(spec.d_model, spec.n_head) for _ in range(spec.n_layer)
        )
        self.ln_f = nn.LayerNorm(spec.d_model)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------
# The three kinds of runs; each returns (per-step seconds, model state bytes)


def _state_bytes(params, optimizer) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in params:
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
        for state in optimizer.state.get(p, {}).values():
            if torch.is_tensor(state) and state.dim() > 0:
                total += local(state).numel() * state.element_size()
    return total


def _timed_steps(step, steps: int) -> list[float]:
    times = []
    for i in range(steps + 2):  # two warm-up steps
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step(i)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times


def _batch(spec: ModelSpec, batch: int, seq: int, step: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def axonn_step(rank: int, spec: ModelSpec, grid: Grid, batch: int, seq: int):
    """(one training step of ours on this rank, the model, the optimizer)."""
    from axonn_launch.train.models.gpt import GPT, clip_grad_norm_, finish_gradients
    from axonn_launch.train.parallel.groups import build_groups

    groups = build_groups(grid, rank=rank)
    model = GPT(spec, groups=groups, overlap=OverlapConfig(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    c = grid.coords(rank)
    shard = c.data * grid.z + c.z

    def step(i: int) -> None:
        idx, targets = (t.chunk(grid.data * grid.z)[shard] for t in _batch(spec, batch, seq, i))
        model(idx, targets).backward()
        finish_gradients(model, groups)
        clip_grad_norm_(model, MAX_NORM, groups)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, model, opt


def run_axonn(rank: int, spec: ModelSpec, grid: Grid, batch: int, seq: int, steps: int):
    step, model, opt = axonn_step(rank, spec, grid, batch, seq)
    times = _timed_steps(step, steps)
    return times, _state_bytes(list(model.parameters()), opt)


def _clip_mixed(params, max_norm: float) -> None:
    """Global-norm clipping over sharded DTensor and replicated plain gradients
    (``clip_grad_norm_`` refuses a mix of the two)."""
    sharded, replicated = torch.zeros(()), torch.zeros(())
    for p in params:
        grad = p.grad
        if hasattr(grad, "to_local"):
            local = grad.to_local()
            if any(placement.is_shard() for placement in grad.placements):
                sharded += local.pow(2).sum()
                continue
            grad = local
        replicated += grad.pow(2).sum()
    dist.all_reduce(sharded)
    coef = (max_norm / ((sharded + replicated).sqrt() + 1e-6)).clamp(max=1.0)
    for p in params:
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)


def torch_tp_step(spec: ModelSpec, world: int, batch: int, seq: int):
    """(one training step of PyTorch TP on this rank, the model, the optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = PlainGPT(spec)
    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
    }  # fmt: skip
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        idx, targets = _batch(spec, batch, seq, i)
        model(idx, targets).backward()
        _clip_mixed(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, model, opt


def run_torch_tp(rank: int, spec: ModelSpec, world: int, batch: int, seq: int, steps: int):
    step, model, opt = torch_tp_step(spec, world, batch, seq)
    times = _timed_steps(step, steps)
    return times, _state_bytes(list(model.parameters()), opt)


def run_single(spec: ModelSpec, batch: int, seq: int, steps: int):
    from axonn_launch.train.models.gpt import GPT, clip_grad_norm_, finish_gradients
    from axonn_launch.train.parallel.groups import single_process_groups

    groups = single_process_groups()
    model = GPT(spec, groups=groups, overlap=OverlapConfig(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        model(*_batch(spec, batch, seq, i)).backward()
        finish_gradients(model, groups)
        clip_grad_norm_(model, MAX_NORM, groups)
        opt.step()
        opt.zero_grad(set_to_none=False)

    times = _timed_steps(step, steps)
    return times, _state_bytes(list(model.parameters()), opt)


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it is not inherited
    from the parent of a spawned process)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------
# --profile: where a step's time goes, as shares of profiler self time (not wall-clock)

KINDS = (
    ("collective", ("gloo", "c10d", "allreduce", "all_reduce", "allgather", "all_gather",
                    "reduce_scatter", "_reduce_scatter", "record_param_comms", "wait")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
              "aten::matmul")),
    ("copy", ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::stack",
              "aten::_to_copy", "aten::index_select", "aten::embedding", "aten::gather")),
    ("optimizer", ("adam", "_foreach", "optimizer")),
)  # fmt: skip


def op_kind(name: str) -> str:
    """The kind of a profiler op. The self time of an autograd Function's own event
    (``_TPLinearFunction``, ...) is its Python and, above all, the blocking waits of the
    collectives it issues (gloo's wait is no op of its own), hence its own kind."""
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(needle.lower() in lowered for needle in needles):
            return kind
    if "::" not in name and name != "PythonSubclass":
        return "autograd Function (Python + blocking waits)"
    return "elementwise/other"


def profile_steps(step, steps: int) -> dict:
    """Self CPU time per op over ``steps`` steps after two warm-up steps (rank-local)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(2):
        step(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2, 2 + steps):
            step(i)
    ops = {}
    for event in prof.key_averages():
        ops[event.key] = (event.self_cpu_time_total / steps / 1e3, event.count / steps)
    return ops  # name -> (self ms per step, calls per step)


def _axonn_collectives(step, model) -> list[tuple[str, str, str, int, int]]:
    """(op, axis, tag group, count, elements) per step, from the Comm recorder."""
    with model.comm.recording() as rec:
        step(100)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for r in rec.records:
        tag = r.tag.split(".")[-1] if r.tag.startswith("blocks.") else r.tag
        entry = groups.setdefault((r.op, r.axis, tag), [0, 0])
        entry[0] += 1
        entry[1] += r.numel
    return sorted((op, axis, tag, n, e) for (op, axis, tag), (n, e) in groups.items())


def _profile_worker(rank: int, world: int, kind: str, args: dict) -> dict:
    spec, batch, seq = ModelSpec(**args["spec"]), args["batch"], args["seq"]
    if kind == "torch_tp":
        step, model, _ = torch_tp_step(spec, world, batch, seq)
        collectives = None
    else:
        step, model, _ = axonn_step(rank, spec, Grid(**args["grid"]), batch, seq)
        collectives = _axonn_collectives(step, model)
    ops = profile_steps(step, args["steps"])
    return {"ops": ops, "collectives": collectives}


def _profile_table(label: str, result: dict) -> list[str]:
    ops = result["ops"]
    total = sum(ms for ms, _ in ops.values()) or float("nan")
    kinds: dict[str, float] = {}
    for name, (ms, _) in ops.items():
        kinds[op_kind(name)] = kinds.get(op_kind(name), 0.0) + ms
    lines = [f"### {label}", "", f"Self CPU time of rank 0: {total:.0f} ms per step.", "",
             "| kind | share | ms per step |", "|---|---|---|"]  # fmt: skip
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {ms / total:.1%} | {ms:.0f} |")
    lines += ["", "| top op | kind | share | calls per step |", "|---|---|---|---|"]
    for name, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:12]:
        lines.append(f"| `{name}` | {op_kind(name)} | {ms / total:.1%} | {calls:.0f} |")
    if result["collectives"] is not None:
        lines += ["", "| collective | axis | tag | per step | elements per step |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for op, axis, tag, n, elements in result["collectives"]:
            lines.append(f"| {op} | {axis} | {tag} | {n} | {elements} |")
    else:
        c10d = {k: calls for k, (_, calls) in ops.items() if k.startswith("c10d::")}
        lines += ["", "c10d ops per step: " + ", ".join(f"`{k}` {v:.0f}" for k, v in
                                                        sorted(c10d.items()))]  # fmt: skip
    return lines + [""]


def profile_report(args: dict, grids: list[Grid]) -> str:
    results = [("PyTorch TP (Colwise/Rowwise)", run_world("profile:torch_tp", 4, args))]
    for grid in grids:
        grid_args = {**args, "grid": grid.as_dict()}
        results.append((f"ours {grid.describe()}", run_world("profile:axonn", 4, grid_args)))
    lines = []
    for label, per_rank in results:
        lines += _profile_table(label, per_rank[0]["profile"])
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int, out_dir: str, kind: str, args: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))  # fmt: skip
    spec = ModelSpec(**args["spec"])
    if kind.startswith("profile:"):
        result = _profile_worker(rank, world, kind.split(":", 1)[1], args) if rank == 0 else None
        if rank != 0:  # the other ranks run the same steps unprofiled
            _profile_worker(rank, world, kind.split(":", 1)[1], args)
        Path(out_dir, f"{rank}.json").write_text(json.dumps({"profile": result}))
        dist.barrier()
        dist.destroy_process_group()
        return
    if kind == "torch_tp":
        times, state = run_torch_tp(rank, spec, world, args["batch"], args["seq"], args["steps"])
    else:
        grid = Grid(**args["grid"])
        times, state = run_axonn(rank, spec, grid, args["batch"], args["seq"], args["steps"])
    rss = peak_rss_bytes()
    Path(out_dir, f"{rank}.json").write_text(
        json.dumps({"times": times, "state": state, "rss": rss})
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(kind: str, world: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), out_dir, kind, args), nprocs=world, join=True)
        return [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------


def _step_seconds(per_rank: list[dict]) -> float:
    """Median over steps of the slowest rank's step time."""
    steps = range(len(per_rank[0]["times"]))
    return statistics.median(max(r["times"][i] for r in per_rank) for i in steps)


def _row(label: str, ranks: int, rounds: list[list[dict]], full_state: int, shards: int) -> str:
    step = min(_step_seconds(per_rank) for per_rank in rounds)
    state = max(r["state"] for r in rounds[-1])
    rss = max(r["rss"] for r in rounds[-1])
    return (
        f"| {label} | {ranks} | {step * 1000:.0f} | {state / 2**20:.1f} | "
        f"{state / full_state:.3f} | {1 / shards:.3f} | {rss / 2**20:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="repeat all runs; keep the best")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="profile shares, not timings")
    a = parser.parse_args()
    spec = ModelSpec("bench", n_layer=a.layers, d_model=a.hidden, n_head=a.heads,
                     vocab_size=a.vocab, max_seq_len=a.seq)  # fmt: skip
    args = {"spec": spec.__dict__, "batch": a.batch, "seq": a.seq, "steps": a.steps}
    torch.set_num_threads(1)
    command = "python bench/bench_tp.py " + " ".join(sys.argv[1:])
    if a.profile:
        report = profile_report(args, [Grid(x=4), Grid(y=4), Grid(x=2, y=2)])
        header = (
            f"# Where a tensor-parallel step goes (torch.profiler self time, rank 0)\n\n"
            f"Model: {spec.n_layer} layers, h={spec.d_model}, {spec.n_head} heads, "
            f"s={a.seq}, vocab {spec.vocab_size}; {a.batch} sequences per step; "
            f"{a.steps} profiled steps after 2 warm-up steps; gloo, 4 ranks, one "
            f"thread each, torch {torch.__version__}.\n\nCommand: `{command.strip()}`\n\n"
        )
        print(header + report)
        out = a.out or PROFILE_RESULTS
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + report)
        return

    def single() -> list[dict]:
        times, state = run_single(spec, a.batch, a.seq, a.steps)
        return [{"times": times, "state": state, "rss": peak_rss_bytes()}]

    runs = [
        ("(a) 1 rank", 1, 1, single),
        ("(b) PyTorch TP (Colwise/Rowwise)", 4, 4, lambda: run_world("torch_tp", 4, args)),
    ]
    for grid in (Grid(x=2, y=2), Grid(x=4), Grid(y=4), Grid(z=4)):
        grid_args = {**args, "grid": grid.as_dict()}
        runs.append((f"(c) ours {grid.describe()}", 4, grid.tensor_parallel,
                     lambda grid_args=grid_args: run_world("axonn", 4, grid_args)))  # fmt: skip
    load_before = os.getloadavg()[0]
    results: dict[str, list[list[dict]]] = {label: [] for label, *_ in runs}
    for _ in range(a.rounds):
        for label, _, _, run in runs:
            results[label].append(run())
    load_after = os.getloadavg()[0]
    full_state = results[runs[0][0]][-1][0]["state"]
    rows = [_row(label, ranks, results[label], full_state, shards)
            for label, ranks, shards, _ in runs]  # fmt: skip

    report = "\n".join([
        "# Tensor-parallel step time and memory",
        "",
        f"Model: {spec.n_layer} layers, h={spec.d_model}, {spec.n_head} heads, s={a.seq}, "
        f"vocab {spec.vocab_size} ({spec.n_params() / 1e6:.1f}M parameters, fp32); "
        f"{a.batch} sequences per step; AdamW with clipping. Step time: median of {a.steps} "
        f"steps after 2 warm-up steps (slowest rank), best of {a.rounds} rounds.",
        f"Machine: {os.cpu_count()} CPU cores, gloo, one thread per rank, "
        f"torch {torch.__version__}; 1-minute load average {load_before:.1f} before and "
        f"{load_after:.1f} after (other work on the machine makes step times noisy).",
        "",
        "| run | ranks | step ms | params+grads+AdamW MiB per rank | fraction of 1 rank | "
        "target 1/(x*y*z) | peak RSS MiB per rank |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Command: `{command.strip()}`",
        "",
    ])  # fmt: skip
    print(report)
    out = a.out or RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)


if __name__ == "__main__":
    main()
