"""``python -m axonn_launch.train.rehearse.rank <job_dir>``: one real rank of the job in
``job_dir``, on this computer, with torch's fake process group at the job's full world
size (``rehearse=rank`` on the launcher; ``submit/rank_rehearsal.py`` starts this).

The rank runs the training core's own code: it creates every group of the 4D grid
(``parallel/groups.build_groups``), builds its shard of the model at the real shapes
(bf16 autocast over fp32 master weights, as on a GPU), runs one or two micro-steps of
forward and backward at the planner's micro-batch, one optimizer step, then saves and
loads its DCP shard. Collectives return at once and communicate nothing (the fake
backend), so values are not the job's; shapes, memory and local compute are.

Each phase's wall time and peak resident set size (``VmHWM``, reset before each phase by
``/proc/self/clear_refs``) go into ``<job_dir>/rank_rehearsal.json`` beside the cost
model's figures that the launcher put in ``rank_rehearsal_request.json``.
DCP with a fake group: a rank other than 0 cannot receive the coordinator's plan (the
scatter returns nothing, and unpickling it fails), so the shard is saved on a group of
this rank alone: the rank is its own coordinator, and ``.metadata`` lists its own shard.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.checkpoint.manager import Checkpointer, load_state
from axonn_launch.train.checkpoint.state import (
    MOMENTS,
    ensure_optimizer_state,
    moment_key,
    save_training_state,
    shard_specs,
)
from axonn_launch.train.models.adamw import AdamW
from axonn_launch.train.models.gpt import clip_grad_norm_, finish_gradients
from axonn_launch.train.models.optim import autocast, build_optimizer, compute_dtype
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.bootstrap import DistEnv
from axonn_launch.train.parallel.comm import resolve_wire
from axonn_launch.train.parallel.groups import build_groups

REQUEST = "rank_rehearsal_request.json"
RECORD = "rank_rehearsal.json"
LABEL = "measured on one real rank with fake collectives (torch fake process group)"
GIB = 1024**3
# the cost model's terms alive at each phase's peak (cost/memory.py's names)
PHASE_TERMS = {
    "init": ("parameters", "optimizer"),
    "forward": ("parameters", "optimizer", "weight buffers", "weight cache",
                "embedding buffers", "activations", "head input", "logits"),
    "backward": None,  # every term but the runtime reserve
    "optimizer step": ("parameters", "gradients", "optimizer", "reduce-scatter buffers"),
}  # fmt: skip


def status_bytes(field_name: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def reset_peak() -> bool:
    """Hand freed heap back to the kernel (glibc's ``malloc_trim``), then reset ``VmHWM``
    to the current RSS: a phase's peak is then its own. False where either is refused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, AttributeError):
        return False
    return True


@dataclass
class Phases:
    """Wall time and peak RSS of each phase, above the baseline RSS."""

    baseline: int
    resets: bool = True
    rows: list[dict] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, **extra: object) -> Iterator[dict]:
        self.resets = reset_peak() and self.resets
        row: dict = {"phase": name, **extra}
        started = time.perf_counter()
        yield row
        row["seconds"] = time.perf_counter() - started
        row["peak_rss_bytes"] = status_bytes("VmHWM")
        row["peak_above_baseline_bytes"] = row["peak_rss_bytes"] - self.baseline
        self.rows.append(row)


def warm_up() -> None:
    """Page in what every step uses (bf16 GEMMs under autocast, a backward, an AdamW
    step) once on a tiny layer, so that the baseline holds it and the phases do not."""
    layer = torch.nn.Linear(64, 64)
    optimizer = AdamW([{"params": layer.parameters()}], lr=1e-3)
    with autocast(torch.device("cpu"), torch.bfloat16):
        loss = layer(torch.randn(8, 64)).float().square().mean()
    loss.backward()
    optimizer.step()


def join_fake_world(rank: int, world_size: int) -> None:
    """The default group: ``world_size`` ranks, of which this process is ``rank``."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def rank_env(rank: int, world_size: int, tasks_per_node: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank % tasks_per_node, world_size=world_size,
                   local_world_size=tasks_per_node, master_addr="127.0.0.1", master_port=0,
                   device="cpu", backend="fake", source="rehearsal")  # fmt: skip


def groups_created() -> int:
    """Process groups this process has created so far (torch's own count)."""
    return int(dist.distributed_c10d._world.group_count)


def bit_sums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """An exact checksum per tensor: the sum of its bits read as integers (NaN-safe: fake
    collectives leave gathered buffers with whatever was in memory)."""
    out = {}
    for name, t in tensors.items():
        ints = t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)
        out[name] = int(ints.sum(dtype=torch.int64))
    return out


def token_batch(spec: JobSpec, index: int) -> tuple:
    """This rank's rows of one micro-batch (micro_batch / z sequences), random tokens: the
    values do not matter with fake collectives, the shapes are the job's."""
    rows = spec.train.micro_batch // spec.grid.z
    generator = torch.Generator().manual_seed(spec.train.seed + index)
    shape = (rows, spec.train.seq_len + 1)
    tokens = torch.randint(spec.model.vocab_size, shape, generator=generator)
    return tokens[:, :-1], tokens[:, 1:], None


def job_model(spec: JobSpec, env: DistEnv, groups):
    """The spec's architecture sharded over ``groups``, as the job builds it
    (``train/run.build_job_model``, which this folder may not import)."""
    train, device = spec.train, torch.device(env.device)
    return build_model(
        spec.model, groups=groups, overlap=train.overlap,
        activation_checkpointing=train.activation_checkpointing, seed=train.seed,
        device=device, wire=resolve_wire(train.wire, compute_dtype(train, device)),
        cache_layers=train.cache_layers, ors_window=train.ors_window,
        gemm_tuning=train.gemm_tuning,
    )  # fmt: skip


def micro_step(model, batch, phases: Phases, index: int, dtype: torch.dtype) -> None:
    """Forward, then backward, of one micro-batch, each a phase."""
    inputs, targets, examples = batch
    normalizer = torch.tensor(float(targets.numel()))
    with phases.phase("forward", micro_step=index), autocast(torch.device("cpu"), dtype):
        loss = model(inputs, targets, normalizer=normalizer, examples=examples)
    with phases.phase("backward", micro_step=index):
        loss.backward()


def optimizer_step(model, optimizer, spec: JobSpec, phases: Phases) -> None:
    with phases.phase("optimizer step"):
        finish_gradients(model, model.groups, average=False)
        max_norm = spec.train.grad_clip if spec.train.grad_clip > 0 else math.inf
        clip_grad_norm_(model, max_norm, model.groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def saved_tensors(model, optimizer, keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Parameters and both moments under their checkpoint keys (``checkpoint/state.py``);
    only ``keys`` when given."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.data
        for moment in MOMENTS:
            out[moment_key(name, moment)] = optimizer.state[param][moment]
    return out if keys is None else {k: v for k, v in out.items() if k in keys}


def save_and_load(model, optimizer, spec: JobSpec, rank: int, phases: Phases) -> dict:
    """This rank's DCP shard, saved by the job's own code (banded; a tensor replicated
    over other ranks is written by its one owner), then read back: every key this rank
    wrote, compared bit for bit. Both on a group of this rank alone (module docstring)."""
    own = dist.new_group([rank])
    root = Path(spec.job_dir) / "rank_rehearsal"
    checkpointer = Checkpointer(root, rank=0, keep=1, group=own, asynchronous=False)
    meta = {"grid": spec.grid.as_dict(), "world_size": spec.grid.world_size}
    with phases.phase("save") as row:
        save_training_state(checkpointer, 1, model=model, optimizer=optimizer,
                            loader_state={"step": 1}, rng={}, groups=model.groups,
                            meta=meta)  # fmt: skip
        path = checkpointer.wait()
        files = sorted(p for p in path.iterdir() if p.is_file())
        row["bytes_written"] = sum(p.stat().st_size for p in files)
    specs = shard_specs(model, model.groups, banded=False)
    written = {key for key, s in specs.items() if s.writes}
    before = bit_sums(saved_tensors(model, optimizer, written))
    for tensor in saved_tensors(model, optimizer, written).values():
        tensor.zero_()
    with phases.phase("load") as row, torch.no_grad():
        state = saved_tensors(model, optimizer, written)
        row["bytes_read"] = load_state(path, state, {k: specs[k] for k in state}, group=own)
    after = bit_sums(saved_tensors(model, optimizer, written))
    return {
        "dir": str(path),
        "files": [p.name for p in files],
        "bytes_written": phases.rows[-2]["bytes_written"],
        "tensors_written": len(written),
        "tensors_owned_elsewhere": len(specs) - len(written),
        "reloaded_equal": before == after,
        "coordinator": "this rank, on a group of its own (fake collectives cannot carry"
        " rank 0's plan to another rank)",
    }


def rehearse(job_dir: Path, request: dict) -> dict:
    """Every phase of rank ``request['rank']``; returns the record (module docstring)."""
    spec = JobSpec.load(JobPaths(job_dir).spec)
    # bf16 as on a GPU; no GEMM layout tuning: it times layouts for the GPU in the job's
    # first steps, and here would time this CPU's (ten times the micro-step's GEMMs)
    train = replace(spec.train, dtype="bf16", gemm_tuning=False)
    spec = replace(spec, train=train, job_dir=str(job_dir))
    rank, world = request["rank"], spec.grid.world_size
    torch.set_num_threads(request.get("threads", 1))
    join_fake_world(rank, world)
    warm_up()
    phases = Phases(baseline=status_bytes("VmRSS"))
    first = groups_created()
    with phases.phase("groups") as row:
        groups = build_groups(spec.grid, rank=rank)
    row["groups_created"] = groups_created() - first
    model, optimizer = init_shard(spec, rank, request, groups, phases)
    model.train()
    for index in range(request.get("micro_steps", 1)):
        micro_step(model, token_batch(spec, index), phases, index, torch.bfloat16)
    optimizer_step(model, optimizer, spec, phases)
    checkpoint = save_and_load(model, optimizer, spec, rank, phases)
    dist.destroy_process_group()
    return record(spec, request, groups, phases, checkpoint)


def init_shard(spec: JobSpec, rank: int, request: dict, groups, phases: Phases):
    """The model's shard and the optimizer's moments, as a resumed job holds them."""
    env = rank_env(rank, spec.grid.world_size, request.get("tasks_per_node", 1))
    with phases.phase("init") as row:
        torch.manual_seed(spec.train.seed)
        model = job_model(spec, env, groups)
        optimizer = build_optimizer(model, spec.train)
        ensure_optimizer_state(model, optimizer)
        row["local_parameters"] = sum(p.numel() for p in model.parameters())
    return model, optimizer


def record(spec: JobSpec, request: dict, groups, phases: Phases, checkpoint: dict) -> dict:
    terms = request.get("model_terms", {})
    for row in phases.rows:
        names = PHASE_TERMS.get(row["phase"], ())
        alive = [k for k in terms if k != "runtime reserve"] if names is None else names
        row["model_bytes"] = sum(terms.get(k, 0.0) for k in alive) if terms and alive else None
    peak = max(phases.rows, key=lambda r: r["peak_above_baseline_bytes"])
    model_bytes = sum(v for k, v in terms.items() if k != "runtime reserve") if terms else None
    ratio = peak["peak_above_baseline_bytes"] / model_bytes if model_bytes else None
    return {
        "label": LABEL,
        "rank": groups.rank,
        "world_size": spec.grid.world_size,
        "grid": spec.grid.as_dict(),
        "coords": groups.coords._asdict()
        if hasattr(groups.coords, "_asdict")
        else str(groups.coords),
        "model": spec.model.name,
        "micro_batch": spec.train.micro_batch,
        "rows_per_rank": spec.train.micro_batch // spec.grid.z,
        "seq_len": spec.train.seq_len,
        "dtype": "bf16 autocast over fp32 master weights and AdamW moments",
        "gemm_tuning": False,
        "threads": torch.get_num_threads(),
        "baseline_rss_bytes": phases.baseline,
        "peak_reset_per_phase": phases.resets,
        "phases": phases.rows,
        "peak_phase": peak["phase"],
        "peak_above_baseline_bytes": peak["peak_above_baseline_bytes"],
        "model_bytes": model_bytes,
        "model_terms": terms,
        "ratio_to_model": ratio,
        "within_15_percent": ratio is not None and abs(ratio - 1) <= 0.15,
        "groups_seconds": phases.rows[0]["seconds"],
        "checkpoint": {**checkpoint, "predicted_bytes": request.get("checkpoint_bytes")},
        "predicted": request.get("predicted", {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m axonn_launch.train.rehearse.rank")
    parser.add_argument(
        "job_dir", type=Path, help=f"a job directory holding spec.json and {REQUEST}"
    )
    job_dir = parser.parse_args(argv).job_dir.resolve()
    request = json.loads((job_dir / REQUEST).read_text())
    result = rehearse(job_dir, request)
    (job_dir / RECORD).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
