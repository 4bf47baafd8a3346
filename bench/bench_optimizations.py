"""Step time with and without each throughput optimization, side by side in one run.

Runs the real training core (``axonn_launch.train.loop.train_loop``: micro-steps under
the job's autocast, ``finish_gradients``, clipping, AdamW, the step all-reduce) of one
GPT on CPU gloo ranks, one thread each, for these settings, each differing from the
defaults (fp32, every overlap on, wire dtypes auto, cache_layers 0, ors_window 2, GEMM
tuning on) in one knob:

  overlaps        OAR/ORS/OAG all off  vs  all on
  wire dtype      train.dtype=bf16 with every wire fp32  vs  every wire bf16
  weight caching  cache_layers=0  vs  cache_layers=n_layer
  ORS window      ors_window=0 (unbounded)  vs  2
  GEMM tuning     gemm_tuning=false  vs  true

Every setting gets its own model, loader and optimizer inside one world per grid, built
once; each round runs every setting for ``--steps`` timed steps (plus one untimed step
after the switch), in an order rotated by one each round, so that drift in the machine's
load reaches all settings alike. A setting's step time is the median over rounds of the
slowest rank's mean step time. Default grids: z=4 and x=2,z=2 on 4 ranks, x=2,z=4 on 8.

    .venv/bin/python bench/bench_optimizations.py [--quick] [--rounds 5] [--steps 4]
        [--grids z4 x2z2 x2z4] [--layers 4] [--hidden 512] [--heads 8] [--seq 128]
        [--vocab 8192] [--batch 16]

``--quick`` (a tiny model, 1 round of 2 steps, grids z4 and x2z4) only checks that
everything runs, in about two minutes. Writes bench/results/optimizations.md (table and
command) and bench/results/optimizations.json (every round's time, per setting).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.grid import Grid  # noqa: E402
from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.common.spec import OverlapConfig, TrainConfig, WireConfig  # noqa: E402

RESULTS = REPO / "bench" / "results"
ALL_OFF = OverlapConfig(all_reduce=False, reduce_scatter=False, all_gather=False)
CACHE_ALL = -1  # stands for cache_layers = n_layer

# setting name -> TrainConfig fields that differ from the defaults
SETTINGS: dict[str, dict] = {
    "defaults": {},
    "overlaps off": {"overlap": ALL_OFF},
    "cache_layers=n_layer": {"cache_layers": CACHE_ALL},
    "ors_window=0": {"ors_window": 0},
    "gemm_tuning=false": {"gemm_tuning": False},
    "bf16, wire fp32": {"dtype": "bf16", "wire": WireConfig("fp32", "fp32", "fp32")},
    "bf16, wire bf16": {"dtype": "bf16", "wire": WireConfig("bf16", "bf16", "bf16")},
}
# (optimization, setting without it, setting with it)
COMPARISONS = [
    ("overlaps OAR+ORS+OAG", "overlaps off", "defaults"),
    ("wire dtype bf16 (train.dtype=bf16)", "bf16, wire fp32", "bf16, wire bf16"),
    ("weight caching", "defaults", "cache_layers=n_layer"),
    ("ORS window 2 (vs unbounded)", "ors_window=0", "defaults"),
    ("GEMM tuning", "gemm_tuning=false", "defaults"),
]
# GPT keyword -> the TrainConfig field it comes from (a keyword the model does not take
# yet is left out, and the report says which: those rows compare identical runs)
MODEL_KNOBS = {
    "overlap": "overlap",
    "wire": "wire",
    "cache_layers": "cache_layers",
    "ors_window": "ors_window",
    "gemm_tuning": "gemm_tuning",
}


def parse_grid(text: str) -> Grid:
    sizes = {axis: int(n) for axis, n in re.findall(r"(data|x|y|z)(\d+)", text)}
    return Grid(**sizes)


def train_config(name: str, args: dict) -> TrainConfig:
    overrides = dict(SETTINGS[name])
    if overrides.get("cache_layers") == CACHE_ALL:
        overrides["cache_layers"] = args["model"]["n_layer"]
    base = TrainConfig(
        steps=0, global_batch=args["batch"], micro_batch=args["batch"] // args["data"],
        seq_len=args["seq"], warmup_steps=1, data="synthetic", progress=False,
    )  # fmt: skip
    return replace(base, **overrides)


# ---------------------------------------------------------------------------------------
# One rank: build every setting once, then interleave them


@dataclass
class Setting:
    model: torch.nn.Module
    ctx: object  # TrainContext
    done: int = 0  # optimizer steps run so far
    times: list[float] = field(default_factory=list)


def build_setting(name: str, args: dict, grid: Grid, groups, rank: int) -> tuple[Setting, list]:
    """The model, loader and optimizer of one setting; also the knobs GPT ignored."""
    from axonn_launch.train.data import Geometry, Loader, open_source
    from axonn_launch.train.loop import TrainContext
    from axonn_launch.train.metrics import MetricsLogger
    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.models.optim import build_optimizer

    spec, train, device = ModelSpec(**args["model"]), train_config(name, args), torch.device("cpu")
    accepted = inspect.signature(GPT).parameters
    knobs = {kw: getattr(train, f) for kw, f in MODEL_KNOBS.items() if kw in accepted}
    ignored = [kw for kw in MODEL_KNOBS if kw not in accepted]
    if "wire" in knobs:  # as axonn_launch.train.run builds it: auto follows the compute
        from axonn_launch.train.models.optim import compute_dtype
        from axonn_launch.train.parallel.comm import resolve_wire

        knobs["wire"] = resolve_wire(train.wire, compute_dtype(train, device))
    torch.manual_seed(train.seed)
    model = GPT(spec, groups=groups, seed=train.seed, device=device, **knobs)
    loader = Loader(open_source("synthetic", model_vocab=spec.vocab_size),
                    Geometry.of(train, grid, groups.coords), seed=train.seed,
                    device=device)  # fmt: skip
    logger = MetricsLogger(
        job_dir=Path(args["out_dir"]), model=spec, seq_len=train.seq_len, recompute=False,
        world_size=grid.world_size, peak_tflops_per_gpu=0.0, total_steps=0, device=device,
        enabled=False, progress=False,
    )  # fmt: skip
    ctx = TrainContext(
        train=train, groups=groups, loader=loader, optimizer=build_optimizer(model, train),
        logger=logger, device=device, tokens_per_step=train.global_batch * train.seq_len,
    )  # fmt: skip
    return Setting(model, ctx), ignored


def run_steps(setting: Setting, steps: int) -> float:
    """Mean seconds of ``steps`` steps after one untimed step (the switch between
    settings leaves caches cold), through the real ``train_loop``."""
    from axonn_launch.train.loop import train_loop

    ctx = setting.ctx
    ctx.start_step = setting.done
    ctx.train = replace(ctx.train, steps=setting.done + steps + 1)
    dist.barrier()
    summary = train_loop(setting.model, ctx)  # its step_time_s leaves out the first step
    setting.done += steps + 1
    return summary["step_time_s"]


def run_rank(rank: int, args: dict) -> dict:
    from axonn_launch.train.loop import gemm_tuner
    from axonn_launch.train.parallel.groups import build_groups

    grid = Grid(**args["grid"])
    groups = build_groups(grid, rank=rank)
    settings, ignored = {}, []
    for name in SETTINGS:
        settings[name], ignored = build_setting(name, args, grid, groups, rank)
        run_steps(settings[name], 1)  # warm-up, GEMM tuning included
    names = list(SETTINGS)
    for round_index in range(args["rounds"]):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            settings[name].times.append(run_steps(settings[name], args["steps"]))
    tuner = gemm_tuner(settings["defaults"].model)
    return {
        "times": {name: s.times for name, s in settings.items()},
        "ignored_knobs": ignored,
        "gemm_choices": tuner.choices() if tuner is not None else {},
    }


def _worker(rank: int, world: int, port: int, args: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=900))  # fmt: skip
    try:
        result = run_rank(rank, args)
        Path(args["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_grid(grid: Grid, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        world_args = {**args, "grid": grid.as_dict(), "data": grid.data, "out_dir": out_dir}
        mp.spawn(_worker, args=(grid.world_size, _free_port(), world_args),
                 nprocs=grid.world_size, join=True)  # fmt: skip
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text())
                for r in range(grid.world_size)]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Report


def round_times(per_rank: list[dict], name: str) -> list[float]:
    """Per round, the slowest rank's mean step time of setting ``name``."""
    rounds = len(per_rank[0]["times"][name])
    return [max(r["times"][name][i] for r in per_rank) for i in range(rounds)]


def grid_rows(grid: Grid, per_rank: list[dict]) -> list[str]:
    med = {name: statistics.median(round_times(per_rank, name)) for name in SETTINGS}
    spread = {name: (min(t), max(t)) for name in SETTINGS if (t := round_times(per_rank, name))}
    rows = []
    for label, without, with_ in COMPARISONS:
        cells = []
        for name in (without, with_):
            low, high = spread[name]
            cells.append(f"{name} | {med[name] * 1e3:.1f} ({low * 1e3:.1f}-{high * 1e3:.1f})")
        ratio = med[without] / med[with_]
        rows.append(f"| {grid.describe()} ({grid.world_size}) | {label} | {' | '.join(cells)} "
                    f"| {ratio:.2f} |")  # fmt: skip
    return rows


def gemm_summary(results: dict[str, list[dict]]) -> list[str]:
    lines = []
    for grid_text, per_rank in results.items():
        totals: dict[str, int] = {}
        for rank in per_rank:
            for pick in rank["gemm_choices"].values():
                totals[pick] = totals.get(pick, 0) + 1
        text = ", ".join(f"{n} {c}" for n, c in sorted(totals.items(), key=lambda kv: -kv[1]))
        lines.append(f"- {grid_text}: {text or 'none tuned (all under the FLOP floor)'}")
    return lines


def report(results: dict[str, list[dict]], a: argparse.Namespace, load: tuple) -> str:
    spec = model_spec(a)
    ignored = sorted({k for per_rank in results.values() for k in per_rank[0]["ignored_knobs"]})
    rows = [
        row for text, per_rank in results.items() for row in grid_rows(parse_grid(text), per_rank)
    ]
    command = "python bench/bench_optimizations.py " + " ".join(sys.argv[1:])
    lines = [
        "# Throughput optimizations: step time with and without each",
        "",
        *(
            ["**Quick mode: checks that the benchmark runs; not a measurement.**", ""]
            if a.quick
            else []
        ),  # fmt: skip
        f"Model: {spec.n_layer} layers, h={spec.d_model}, {spec.n_head} heads, s={a.seq}, "
        f"vocab {spec.vocab_size} ({spec.n_params() / 1e6:.1f}M parameters); global batch "
        f"{a.batch} sequences, one micro-step; the real `train_loop` step (AdamW, clipping). "
        f"Step time: the slowest rank's mean of {a.steps} steps per round (after one untimed "
        f"step), median (min-max) over {a.rounds} interleaved rounds, in ms.",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        f"gloo, one thread per rank, torch {torch.__version__}; 1-minute load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after (other work on the machine makes step "
        "times noisy). Ratio: step time without / with (above 1: the optimization helps).",
        "",
        "| grid (ranks) | optimization | without | ms | with | ms | ratio |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "GEMM tuner picks in the `defaults` setting (signatures x ranks):",
        *gemm_summary(results),
        "",
    ]
    if ignored:
        lines += [f"Not implemented by the model in this run (rows with them compare identical "
                  f"runs): {', '.join(ignored)}.", ""]  # fmt: skip
    lines += [f"Command: `{command.strip()}`", ""]
    return "\n".join(lines)


def model_spec(a: argparse.Namespace) -> ModelSpec:
    return ModelSpec("bench", n_layer=a.layers, d_model=a.hidden, n_head=a.heads,
                     vocab_size=a.vocab, max_seq_len=a.seq)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round: a check")
    parser.add_argument("--grids", nargs="+", default=None, help="default: z4 x2z2 x2z4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--out", type=Path, default=RESULTS / "optimizations.md")
    a = parser.parse_args()
    if a.quick:
        a.rounds, a.steps, a.layers, a.hidden, a.heads = 1, 2, 2, 64, 4
        a.seq, a.vocab, a.batch = 64, 256, 8
        a.grids = a.grids or ["z4", "x2z4"]
    a.grids = a.grids or ["z4", "x2z2", "x2z4"]
    return a


def main() -> None:
    a = parse_args()
    spec = model_spec(a)
    args = {"model": spec.__dict__, "batch": a.batch, "seq": a.seq,
            "rounds": a.rounds, "steps": a.steps}  # fmt: skip
    load_before, started = os.getloadavg()[0], time.perf_counter()
    results = {}
    for text in a.grids:
        grid = parse_grid(text)
        results[text] = run_grid(grid, args)
        print(f"{grid.describe()}: done after {time.perf_counter() - started:.0f}s", flush=True)
    text = report(results, a, (load_before, os.getloadavg()[0]))
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    raw = {"command": sys.argv, "args": args, "results": results}
    a.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
