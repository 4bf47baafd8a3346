"""Start, save and resume at the cost of one shard: init time, host memory, bytes read.

For each one-layer model (one at gpt_10b width h=5120, one with a Llama-3-sized token
table h=2048 V=131072) and the same model at half width, side by side:

1. 8 local ranks on x=2 y=2 z=2 (``train.data=synthetic``, short sequences) initialize
   the model, train one step and save a checkpoint (the job's own ``save``, async DCP);
2. 8 ranks on data=2 z=4 resume from it (the job's own ``resume``);
3. one process times the initialization of one rank's shard on grids of 2, 4 and 8
   ranks (one thread, nothing else running in it), beside drawing the full tensors as
   the previous initialization did on every rank.

Per rank: peak host RSS (``ru_maxrss``) after start, after the checkpoint and after the
resume; the bytes of saved items each rank reads while resuming (counted by the DCP
reader); the predictions of ``axonn_launch.cost.jobcost`` beside the measurements.

    .venv/bin/python bench/bench_checkpoint.py [--models wide vocab] [--seq 32]

Writes bench/results/bench_checkpoint.md. Needs about 14 GiB of free memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.grid import Grid  # noqa: E402
from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.common.spec import JobSpec, RuntimeConfig, TrainConfig  # noqa: E402
from axonn_launch.cost.jobcost import PROCESS_BYTES, job_cost  # noqa: E402
from axonn_launch.scheduler.processes import free_port, rank_env  # noqa: E402

MODELS = {
    "wide": [
        ModelSpec("h5120", n_layer=1, d_model=5120, n_head=40, vocab_size=2048, max_seq_len=64),
        ModelSpec("h2560", n_layer=1, d_model=2560, n_head=20, vocab_size=2048, max_seq_len=64),
    ],
    "vocab": [
        ModelSpec(
            "h2048-V131072", n_layer=1, d_model=2048, n_head=16, vocab_size=131072, max_seq_len=64
        ),  # fmt: skip
        ModelSpec(
            "h1024-V131072", n_layer=1, d_model=1024, n_head=8, vocab_size=131072, max_seq_len=64
        ),  # fmt: skip
    ],
}
MODELS["tiny"] = [  # a smoke test of this script, and the process baseline
    ModelSpec("h256", n_layer=1, d_model=256, n_head=4, vocab_size=2048, max_seq_len=64),
    ModelSpec("h128", n_layer=1, d_model=128, n_head=4, vocab_size=2048, max_seq_len=64),
]
SAVE_GRID, RESUME_GRID = Grid(x=2, y=2, z=2), Grid(data=2, z=4)
MB = 1 << 20
POINT = {"save": "after checkpoint", "resume": "after resume"}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- one rank (run as: bench_checkpoint.py --worker PHASE JOB_DIR) ----------------------


def worker(phase: str, job_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from axonn_launch.train import run as job
    from axonn_launch.train.checkpoint.manager import Checkpointer, latest_checkpoint
    from axonn_launch.train.checkpoint.state import load_training_state
    from axonn_launch.train.data import Geometry, Loader, open_source
    from axonn_launch.train.loop import run_micro_steps
    from axonn_launch.train.models.gpt import GPT, clip_grad_norm_, finish_gradients
    from axonn_launch.train.models.optim import build_optimizer, compute_dtype
    from axonn_launch.train.parallel.bootstrap import discover_env, init_distributed
    from axonn_launch.train.parallel.groups import build_groups

    spec = JobSpec.load(job_dir / "spec.json")
    env = discover_env(spec.runtime)
    job.configure_threads(env)
    init_distributed(env)
    group = dist.new_group(backend="gloo")
    groups = build_groups(spec.grid, rank=env.rank)
    out = {"rank": env.rank, "process_bytes": peak_rss()}
    started = time.perf_counter()
    model = GPT(spec.model, groups=groups, overlap=spec.train.overlap, seed=spec.train.seed)
    out["init_s"] = time.perf_counter() - started
    out["shard_elements"] = sum(p.numel() for p in model.parameters())
    out["start_peak"] = peak_rss()
    optimizer = build_optimizer(model, spec.train)
    train = spec.train
    geometry = Geometry(spec.grid, groups.coords, train.micro_batch, train.seq_len, 1)
    loader = Loader(open_source("synthetic", model_vocab=spec.model.vocab_size), geometry,
                    seed=train.seed)  # fmt: skip
    device = torch.device("cpu")
    if phase == "save":
        run_micro_steps(model, loader.next_step(), groups, device, compute_dtype(train, device))
        finish_gradients(model, groups, average=False)
        clip_grad_norm_(model, 1.0, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        checkpointer = Checkpointer(job_dir, rank=env.rank, keep=1, group=group)
        started = time.perf_counter()
        job.save(spec, env, 1, model, optimizer, loader, checkpointer)
        out["save_blocking_s"] = time.perf_counter() - started
        checkpointer.wait()
        out["save_total_s"] = time.perf_counter() - started
        out["save_peak"] = peak_rss()
    else:
        started = time.perf_counter()
        *_, out["bytes_read"] = load_training_state(
            latest_checkpoint(job_dir), model=model, optimizer=optimizer, groups=groups,
            group=group,
        )  # fmt: skip
        out["resume_s"] = time.perf_counter() - started
        out["resume_peak"] = peak_rss()
    (job_dir / f"{phase}_{env.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# --- the parent ----------------------------------------------------------------------


def run_world(phase: str, job_dir: Path, model: ModelSpec, grid: Grid, seq: int) -> list[dict]:
    micro = grid.z
    spec = JobSpec(
        name="bench", job_dir=str(job_dir), model=model, grid=grid,
        train=TrainConfig(steps=1, micro_batch=micro, global_batch=micro * grid.data,
                          seq_len=seq, data="synthetic", progress=False),
        runtime=RuntimeConfig(device="cpu", backend="gloo"),
    )  # fmt: skip
    spec.save(job_dir / "spec.json")
    port = free_port()
    procs = []
    for rank in range(grid.world_size):
        env = rank_env(rank=rank, world_size=grid.world_size, port=port,
                       extra={"PYTHONPATH": str(REPO)})  # fmt: skip
        command = [sys.executable, __file__, "--worker", phase, str(job_dir)]
        procs.append(subprocess.Popen(command, env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{model.name} {phase}: a rank failed")
    return [json.loads((job_dir / f"{phase}_{r}.json").read_text()) for r in range(len(procs))]


def isolated_init(model: ModelSpec) -> dict:
    """One rank's initialization on grids of 2, 4 and 8 ranks, and full draws (one thread)."""
    code = f"""
import json, time, math, torch
torch.set_num_threads(1)
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.parallel.shards import grid_position
from axonn_launch.train.models.gpt import GPT
spec = ModelSpec(**{model.__dict__!r})
out = {{}}
def best(fn):  # the least disturbed of three runs
    times = []
    for _ in range(3):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
        del result
    return min(times)
for grid in (Grid(x=2), Grid(x=2, z=2), Grid(x=2, y=2, z=2)):
    build = lambda: GPT(spec, groups=grid_position(grid, 0), overlap=OverlapConfig())
    out[grid.world_size] = [best(build), sum(p.numel() for p in build().parameters())]
shapes = [p.shard_layout.full_shape for p in GPT(
    spec, groups=grid_position(Grid(x=2, y=2, z=2), 0), overlap=OverlapConfig()).parameters()]
full = best(lambda: [torch.randn(s) for s in shapes])
out["full_draw"] = [full, sum(math.prod(s) for s in shapes)]
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(model: ModelSpec, seq: int, tmp: Path) -> dict:
    job_dir = tmp / model.name
    job_dir.mkdir()
    saved = run_world("save", job_dir, model, SAVE_GRID, seq)
    resumed = run_world("resume", job_dir, model, RESUME_GRID, seq)
    return {"model": model, "save": saved, "resume": resumed, "init": isolated_init(model)}


def mb(x: float) -> str:
    return f"{x / MB:,.0f}"


def rows_for(result: dict) -> tuple[list[str], list[str], list[str]]:
    model, save, resume = result["model"], result["save"], result["resume"]
    memory, reads, init = [], [], []
    for phase, ranks, grid in (("save", save, SAVE_GRID), ("resume", resume, RESUME_GRID)):
        shard = max(r["shard_elements"] for r in ranks)
        budget = 2 * 16 * shard + 600 * MB
        start = max(r["start_peak"] for r in ranks)
        end = max(r[f"{phase}_peak"] for r in ranks)
        cost = job_cost(model, grid, on_gpu=False, process_bytes=PROCESS_BYTES)
        predicted = cost.save_bytes if phase == "save" else cost.resume_bytes
        ok = "yes" if max(start, end) <= budget else "**no**"
        memory.append(
            f"| {model.name} | {grid.describe()} | {shard / 1e6:.1f} | "
            f"{mb(16 * shard)} | {mb(max(r['process_bytes'] for r in ranks))} | {mb(start)} "
            f"({mb(cost.start_bytes)}) | {POINT[phase]} {mb(end)} ({mb(predicted)}) | "
            f"{mb(budget)} | {ok} |"
        )
    shard = max(r["shard_elements"] for r in resume)
    worst = max(r["bytes_read"] for r in resume)
    ratio = worst / (12 * shard)
    reads.append(
        f"| {model.name} | {mb(12 * shard)} | {mb(worst)} | {ratio:.2f} | "
        f"{'yes' if ratio <= 2 else '**no**'} | {max(r['resume_s'] for r in resume):.1f} | "
        f"{max(r['save_blocking_s'] for r in save):.1f} / "
        f"{max(r['save_total_s'] for r in save):.1f} |"
    )
    iso = result["init"]
    in_job = max(r["init_s"] for r in save)
    predicted = job_cost(model, SAVE_GRID, on_gpu=False).init_s
    init.append(
        f"| {model.name} | {iso['2'][0]:.2f} | {iso['4'][0]:.2f} | {iso['8'][0]:.2f} | "
        f"{iso['4'][0] / iso['8'][0]:.2f} | {predicted:.2f} | {in_job:.2f} | "
        f"{iso['full_draw'][0]:.2f} | {iso['8'][1] / iso['8'][0] / 1e6:.1f} |"
    )
    return memory, reads, init


def report(results: list[dict], args, load: tuple[float, float]) -> str:
    memory, reads, init = [], [], []
    for result in results:
        m, r, i = rows_for(result)
        memory += m
        reads += r
        init += i
    return "\n".join([
        "# Checkpoints and initialization at the cost of one shard",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"8 local gloo ranks; one-layer models, seq_len {args.seq}, `train.data=synthetic`, "
        "fp32. Saved on x=2 y=2 z=2 after one step (asynchronous DCP save), resumed on "
        "data=2 z=4.",
        f"Command: `.venv/bin/python bench/bench_checkpoint.py --models {' '.join(args.models)} "
        f"--seq {args.seq}`",
        f"Load average (1 min) at start {load[0]:.1f}, at end {load[1]:.1f}.",
        "",
        "Peak host RSS per rank (MB; the largest rank; in parentheses the prediction of "
        "`axonn_launch.cost.jobcost`, which `plan` prints). Target: every point <= 2 x (parameter "
        "+ gradient + optimizer shard bytes) + 600 MB.",
        "",
        "| model | grid | shard M params | state MB (16 B/param) | process before model | "
        "peak after start (pred.) | peak (pred.) | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
        *memory,
        "",
        "Resume on data=2 z=4: bytes of saved items the worst rank reads, against its new "
        "shard in the checkpoint (parameters and both moments, 12 B/param). Target: <= 2x.",
        "",
        "| model | new shard MB | read MB | ratio | met | resume s | save blocking / total s |",
        "|---|---|---|---|---|---|---|",
        *reads,
        "",
        "Initialization of one rank's shard, one thread, nothing else in the process "
        "(seconds, best of three), on grids of 2, 4 and 8 ranks; the prediction for 8 "
        "ranks; the slowest rank inside the 8-rank job (8 processes on the machine's "
        "cores); and drawing every full tensor, which each rank did before. Target: init "
        "time per rank falls as the rank count doubles.",
        "",
        "| model | 2 ranks | 4 ranks | 8 ranks | 4/8 ratio | predicted 8 | in job (8) | "
        "full draw | M elements/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *init,
        "",
    ])  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["wide", "vocab"], choices=list(MODELS))
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_checkpoint.md"))
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:
        for group in args.models:
            for model in MODELS[group]:
                results.append(measure(model, args.seq, Path(tmp)))
                print(json.dumps({"model": model.name, "init": results[-1]["init"]}), flush=True)
    text = report(results, args, (load_start, os.getloadavg()[0]))
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
