"""Hugging Face import per rank: ``load_hf_weights`` against loading the full checkpoint.

A random-weight Llama of TinyLlama-1.1B's width (hidden 2048, ffn 5632, 32 heads, 4 KV
heads, vocab 32000) with 4 layers, 1.23 GB in fp32, is written here as a sharded
Hugging Face checkpoint: ``config.json`` from ``hf_config_from_spec``, safetensors files
written tensor by tensor (``safetensors.torch.save_file`` per file, no transformers model
in memory) and ``model.safetensors.index.json``. Then, for each grid of 4 gloo ranks and
each importer, 4 fresh rank processes each build our model for the grid (``build_groups``,
``build_model``) and, all at once after a barrier, import the weights:

* ours: ``load_hf_weights`` (each rank reads only the rows and columns of its shard);
* full load, the naive importer: ``safetensors.torch.load_file`` of every file, our full
  tensors by concatenating the HF tensors (``hf_segments``), then ``load_full_state_dict``.

Per rank: import seconds, bytes of tensor data read (``ImportStats.bytes_read``; the
full load reads every tensor) and the process's peak RSS (``VmHWM`` of
``/proc/self/status``, file-backed pages of memory-mapped safetensors included), beside
its RSS once the model is built and before the import. The rounds alternate the order of
the importers; the table shows per-rank medians. Both importers leave identical
parameters (checked on every rank by a checksum of its shard).

    .venv/bin/python bench/bench_hf_import.py [--rounds 2] [--layers 4]

Writes bench/results/bench_hf_import.md. Needs about 10 GiB of free memory (4 ranks of
the full load at once) and 1.3 GB of disk under bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.grid import Grid  # noqa: E402
from axonn_launch.common.hf import INDEX, hf_config_from_spec, hf_segments  # noqa: E402
from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.scheduler.processes import free_port, rank_env  # noqa: E402

MB = 1 << 20
GRIDS = {"x2z2": Grid(x=2, z=2), "z4": Grid(z=4)}
METHODS = ("ours", "full")
LABEL = {"ours": "ours (`load_hf_weights`)", "full": "full load + `load_full_state_dict`"}


def model_spec(layers: int) -> ModelSpec:
    return ModelSpec(
        f"tinyllama-width-{layers}l", arch="llama", n_layer=layers, d_model=2048, n_head=32,
        n_kv_head=4, ffn_hidden=5632, vocab_size=32000, max_seq_len=2048, tie_embeddings=False,
    )  # fmt: skip


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# --- the checkpoint ---------------------------------------------------------------------


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor and its shape, in file order."""
    out = {}
    for ours, segments in hf_segments(spec).items():
        columns = spec.d_ff if ours.endswith("mlp.down.weight") else spec.d_model
        norm = ours.endswith(("ln1.weight", "ln2.weight", "ln_f.weight"))
        for name, rows in segments:
            out[name] = (rows,) if norm else (rows, columns)
    return out


def write_checkpoint(spec: ModelSpec, directory: Path, shard_bytes: int) -> tuple[int, int]:
    """A sharded HF checkpoint of random fp32 tensors; returns (bytes, files)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config_from_spec(spec), indent=2))
    shapes = hf_shapes(spec)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    return total, len(groups)


# --- one rank (run as: bench_hf_import.py --worker METHOD GRID HF_DIR OUT) --------------


def worker(method: str, grid_name: str, hf_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from axonn_launch.common.hf import spec_from_hf_config
    from axonn_launch.common.spec import OverlapConfig
    from axonn_launch.train.models.gpt import load_full_state_dict
    from axonn_launch.train.models.hf_import import load_hf_weights
    from axonn_launch.train.models.registry import build_model
    from axonn_launch.train.parallel.groups import build_groups

    began = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, grid = dist.get_rank(), GRIDS[grid_name]
    groups = build_groups(grid, rank=rank)
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()), "bench")
    model = build_model(spec, groups=groups, overlap=OverlapConfig())
    result = {
        "rank": rank, "build_s": time.perf_counter() - began,
        "coords": " ".join(f"{a}={getattr(groups.coords, a)}" for a in "xyz"),
        "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "rss_before": status_bytes("VmRSS"), "hwm_before": status_bytes("VmHWM"),
    }  # fmt: skip
    dist.barrier()
    started = time.perf_counter()
    if method == "ours":
        result["bytes_read"] = load_hf_weights(model, groups, hf_dir).bytes_read
    else:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values())):
            tensors.update(load_file(str(hf_dir / file)))
        result["bytes_read"] = sum(t.numel() * t.element_size() for t in tensors.values())
        full = {
            ours: torch.cat([tensors[name] for name, _ in segments])
            for ours, segments in hf_segments(spec).items()
        }
        del tensors
        with torch.no_grad():
            load_full_state_dict(model, groups, full)
        del full
    result["seconds"] = time.perf_counter() - started
    result["hwm"] = status_bytes("VmHWM")
    with torch.no_grad():
        result["checksum"] = sum(float(p.double().abs().sum()) for p in model.parameters())
    out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --- the parent -------------------------------------------------------------------------


def run_ranks(method: str, grid_name: str, hf_dir: Path, tmp: Path) -> list[dict]:
    world = GRIDS[grid_name].world_size
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        env = rank_env(rank=rank, world_size=world, port=port, extra={
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})  # fmt: skip
        outs.append(tmp / f"{method}_{grid_name}_{rank}.json")
        command = [sys.executable, __file__, "--worker", method, grid_name, str(hf_dir),
                   str(outs[-1])]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{method} on {grid_name}: a rank failed")
    return [json.loads(path.read_text()) for path in outs]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(results: dict, grid_name: str) -> list[str]:
    rows = []
    rounds = results[(grid_name, "ours")]
    for rank in range(len(rounds[0])):
        cell = {m: [r[rank] for r in results[(grid_name, m)]] for m in METHODS}
        ours, full = cell["ours"], cell["full"]
        hwm = {m: median([r["hwm"] for r in cell[m]]) for m in METHODS}
        read = {m: median([r["bytes_read"] for r in cell[m]]) for m in METHODS}
        secs = {m: median([r["seconds"] for r in cell[m]]) for m in METHODS}
        before = median([r["rss_before"] for r in ours + full])
        rows.append(
            f"| {grid_name} | {rank} | {ours[0]['coords']} | {ours[0]['shard_bytes'] / MB:,.0f} "
            f"| {before / MB:,.0f} | {read['ours'] / MB:,.0f} | {hwm['ours'] / MB:,.0f} | "
            f"{secs['ours']:.2f} | {read['full'] / MB:,.0f} | {hwm['full'] / MB:,.0f} | "
            f"{secs['full']:.2f} | {read['full'] / read['ours']:.2f} | "
            f"{hwm['full'] / hwm['ours']:.2f} | {secs['full'] / secs['ours']:.2f} |"
        )
    return rows


def report(results: dict, spec: ModelSpec, info: dict, args) -> str:
    import torch

    grids = ", ".join(f"{n} ({g.describe()})" for n, g in GRIDS.items())
    return "\n".join([
        "# Hugging Face import: memory and bytes per rank",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        f"{info['mem_total'] / (1 << 30):.0f} GiB, shared with other work while this ran "
        "(times move between runs; memory and bytes do not); "
        f"torch {torch.__version__}; 4 local gloo ranks, one torch thread each.",
        f"Command: `.venv/bin/python bench/bench_hf_import.py --rounds {args.rounds} "
        f"--layers {args.layers}`",
        f"Load average (1 min) at start {info['load'][0]:.1f}, at end {info['load'][1]:.1f}; "
        f"the whole run took {info['wall'] / 60:.1f} min.",
        "",
        f"Model: a random-weight Llama of TinyLlama-1.1B's width ({spec.n_layer} layers, "
        f"hidden {spec.d_model}, ffn {spec.d_ff}, {spec.n_head} heads, {spec.kv_heads} KV "
        f"heads, vocab {spec.vocab_size}, {'tied' if spec.tie_embeddings else 'untied'} head): "
        f"{info['bytes'] / 1e9:.2f} GB of fp32 tensors in {info['files']} safetensors files "
        "(written tensor by tensor, no transformers model in memory; in the page cache "
        f"while the ranks read them). Grids: {grids}. Each rank is a fresh process that "
        "builds our model for its grid, then all 4 import at once. 'ours' = "
        f"{LABEL['ours']}, reading only the rows and columns of the rank's shard from the "
        f"memory-mapped files; 'full' = {LABEL['full']}: `safetensors.torch.load_file` of "
        "every file, our full tensors concatenated from the HF tensors, then the rank's "
        "shard copied out. Peak RSS = `VmHWM` of the rank's process (memory-mapped file "
        "pages it touched included); 'RSS before' = its RSS with the model built, before "
        f"the import. Medians per rank over {args.rounds} rounds (the importers' order "
        "alternates); both importers left identical parameters on every rank.",
        "",
        "| grid | rank | coords | shard MB | RSS before MB | ours read MB | ours peak RSS MB "
        "| ours s | full read MB | full peak RSS MB | full s | read full/ours | "
        "peak RSS full/ours | time full/ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[line for name in GRIDS for line in table(results, name)],
        "",
    ])  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_hf_import.md"))
    args = parser.parse_args()
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    spec = model_spec(args.layers)
    results: dict[tuple[str, str], list[list[dict]]] = {(g, m): [] for g in GRIDS for m in METHODS}
    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:
        hf_dir = Path(tmp) / "hf"
        total, files = write_checkpoint(spec, hf_dir, args.shard_mb * MB)
        print(f"wrote {total / 1e9:.2f} GB in {files} files", flush=True)
        for path in sorted(hf_dir.iterdir()):  # into the page cache, for every run alike
            with path.open("rb") as handle:
                while handle.read(64 * MB):
                    pass
        for r in range(args.rounds):
            for grid_name in GRIDS:
                order = METHODS if r % 2 == 0 else METHODS[::-1]
                for method in order:
                    print(f"round {r} {grid_name} {method}: {mem_available() / MB:,.0f} MB "
                          "available", flush=True)  # fmt: skip
                    ranks = run_ranks(method, grid_name, hf_dir, Path(tmp))
                    results[(grid_name, method)].append(ranks)
                    print(json.dumps(ranks), flush=True)
                ours, full = (results[(grid_name, m)][-1] for m in METHODS)
                for a, b in zip(ours, full):
                    if abs(a["checksum"] - b["checksum"]) > 1e-9 * abs(a["checksum"]):
                        raise SystemExit(f"{grid_name} rank {a['rank']}: importers differ")
    info = {
        "bytes": total, "files": files, "load": (load_start, os.getloadavg()[0]),
        "wall": time.perf_counter() - started,
        "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }  # fmt: skip
    text = report(results, spec, info, args)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
