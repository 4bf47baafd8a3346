"""Preflight: a short check of the allocation before training (on by default on Slurm).

Every rank measures its GEMM rate, the all-reduce bandwidth inside and across nodes and
the network NCCL/RCCL chose; ``judge`` decides the same verdict on every rank. A missing
network plugin, or slow nodes (with ``machine.preflight.on_slow=stop``), stop the job with
one ``PreflightError`` so that ``jobs resubmit`` can exclude them. Rank 0 writes
``preflight.json`` and the verdict in ``job.json``.

What is measured, the rules of the verdict and why: ``docs/recovery.md``
("train/health/preflight.py").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.common.jobdir import JobPaths, update_record
from axonn_launch.common.machine import PreflightExpectations
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.health.faults import preflight_slowdown
from axonn_launch.train.health.startup import enable_nccl_log
from axonn_launch.train.parallel.bootstrap import DistEnv
from axonn_launch.train.parallel.timing import elapsed

log = logging.getLogger(__name__)

WINDOW_S = 0.1  # seconds of GEMMs per timed window
REPEATS = 3  # windows; the best counts
MAX_GEMMS = 10_000  # per window, whatever the first GEMM's time says
ALLREDUCE_ITERS = 5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


STOPPED = "stopped before training (machine.preflight.on_slow=stop); to exclude them:"


class PreflightError(RuntimeError):
    """The allocation is not fit to train on; the message says why, in one line."""


# --- before the process group ----------------------------------------------------------


def prepare(spec: JobSpec, env: DistEnv, environ=os.environ) -> None:
    """Before NCCL starts: ask it for the log lines the plugin check reads."""
    if spec.runtime.preflight and env.backend == "nccl":
        enable_nccl_log(spec.job_dir, env.rank, environ)


def read_expectations(job_dir: str | Path) -> PreflightExpectations:
    """What the launcher wrote for this job; the defaults (no floors) without the file."""
    path = JobPaths(job_dir).preflight_expected
    try:
        return PreflightExpectations(**json.loads(path.read_text()))
    except FileNotFoundError:
        return PreflightExpectations()


# --- measuring -------------------------------------------------------------------------


def _clock(device: torch.device) -> Callable[[], float]:
    """CPU seconds of this thread for CPU GEMMs, wall-clock seconds otherwise."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """CPU GEMMs on the calling thread alone: idle OpenMP workers spin on shared cores and
    their CPU seconds would depend on the load, not on the node."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gemm_tflops(device: torch.device, size: int, dtype: torch.dtype, slowdown: int = 1) -> float:
    """Best TFLOP/s of ``REPEATS`` windows of ``size``-square GEMMs; each GEMM counted
    does ``slowdown`` times the work (1 but under ``AXONN_FAULT=slow@preflight``)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def gemms(count: int) -> None:
        for _ in range(count * slowdown):
            torch.mm(a, b, out=out)

    def timed(count: int) -> float:
        return max(elapsed(lambda: gemms(count), device, clock=_clock(device)), 1e-9)

    with _one_thread(device):
        timed(1)  # warm-up: BLAS handles, kernel choice, caches
        count = max(1, min(MAX_GEMMS, int(WINDOW_S / timed(1))))
        best = min(timed(count) for _ in range(REPEATS))
    return 2 * size**3 * count / best / 1e12


def busbw_gbps(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> float:
    """All-reduce bus bandwidth in GB/s over ``group`` (``size`` ranks), this rank's view."""
    dist.all_reduce(tensor, group=group)  # warm-up; NCCL makes the communicator here

    def all_reduces() -> None:
        for _ in range(ALLREDUCE_ITERS):
            dist.all_reduce(tensor, group=group)

    seconds = max(elapsed(all_reduces, tensor.device) / ALLREDUCE_ITERS, 1e-9)
    return tensor.numel() * tensor.element_size() * 2 * (size - 1) / size / seconds / 1e9


def node_ranks(startup: list[dict]) -> dict[str, list[int]]:
    """Node -> its ranks, nodes in the order of their first rank."""
    nodes: dict[str, list[int]] = {}
    for record in sorted(startup, key=lambda r: r["rank"]):
        nodes.setdefault(str(record.get("node") or record["host"]), []).append(record["rank"])
    return nodes


def _groups(groups: list[list[int]], backend: str) -> list:
    """Every rank makes every group (torch's rule); a non-member gets a placeholder."""
    return [dist.new_group(ranks=ranks, backend=backend) for ranks in groups]


def _measure(groups: list[list[int]], handles: list, rank: int, tensor: torch.Tensor):
    """The bus bandwidth of this rank's group among ``groups``; None if in none."""
    for ranks, handle in zip(groups, handles):
        if rank in ranks:
            return busbw_gbps(tensor, handle, len(ranks))
    return None


def bandwidths(
    env: DistEnv, nodes: dict[str, list[int]], mib: int
) -> tuple[float | None, float | None]:
    """(inside this rank's node, across nodes) bus bandwidth in GB/s; None: not measured.

    All nodes measure at once, each in its own group; then the first rank of each node."""
    tensor = torch.zeros(mib * 2**20 // 4, device=torch.device(env.device))
    inside_groups = [ranks for ranks in nodes.values() if len(ranks) > 1]
    leaders = [[ranks[0] for ranks in nodes.values()]] if len(nodes) > 1 else []
    handles = _groups(inside_groups + leaders, env.backend)
    inside = _measure(inside_groups, handles, env.rank, tensor)
    dist.barrier()
    across = _measure(leaders, handles[len(inside_groups) :], env.rank, tensor)
    dist.barrier()  # every group is idle before any is destroyed
    for ranks, handle in zip(inside_groups + leaders, handles):
        if env.rank in ranks:
            dist.destroy_process_group(handle)
    return inside, across


def measure(
    env: DistEnv, expect: PreflightExpectations, startup: list[dict], environ=os.environ
) -> dict:
    """This rank's numbers (collective: every rank must call it)."""
    mine = next(r for r in startup if r["rank"] == env.rank)
    node = str(mine.get("node") or mine["host"])
    slowdown = preflight_slowdown(rank=env.rank, node=node, environ=environ)
    device = torch.device(env.device)
    tflops = gemm_tflops(device, expect.gemm_size, DTYPES[expect.gemm_dtype], slowdown)
    inside, across = bandwidths(env, node_ranks(startup), expect.allreduce_mib)
    return {
        "rank": env.rank,
        "node": node,
        "host": mine["host"],
        "gemm_tflops": tflops,
        "gemm_clock": "cpu" if device.type == "cpu" else "wall",
        "intra_node_gbps": inside,
        "inter_node_gbps": across,
        "nccl_network": mine.get("nccl_network", ""),
        "plugin_libraries": mine.get("plugin_libraries", []),
    }


# --- judging (pure) --------------------------------------------------------------------


def slow_ranks(rates: Mapping[int, float], fraction: float, floor: float) -> dict[int, str]:
    """Rank -> why it is slow, for the ranks below ``fraction`` x median or ``floor``."""
    median = statistics.median(rates.values())
    slow = {}
    for rank, rate in sorted(rates.items()):
        if rate < fraction * median:
            slow[rank] = f"GEMM {rate:.3g} TFLOP/s < {fraction:g} x the median rank's {median:.3g}"
        elif floor > 0 and rate < floor:
            slow[rank] = (
                f"GEMM {rate:.3g} TFLOP/s < the floor {floor:.3g} (machine.preflight.gemm_floor"
                " x hardware.peak_tflops_per_gpu)"
            )
    return slow


@dataclass(frozen=True)
class PluginCheck:
    note: str  # what was checked, or why not
    problem: str | None = None  # stops the job
    warnings: tuple[str, ...] = ()


def plugin_check(
    results: list[dict], expect: PreflightExpectations, backend: str, nodes: int
) -> PluginCheck:
    """Every rank's network against ``machine.preflight.network`` (multi-node NCCL only)."""
    if backend == "gloo":
        return PluginCheck("network plugin: not checked (gloo has none)")
    if nodes < 2:
        return PluginCheck("network plugin: not checked on one node (needed only across nodes)")
    if not expect.network:
        return PluginCheck("network plugin: not checked (machine.preflight.network is empty)")
    wrong = [r for r in results if not _uses_plugin(r, expect.network)]
    if wrong:
        return PluginCheck("network plugin: missing", _plugin_problem(wrong, expect))
    unlogged = tuple(
        f"rank {r['rank']} ({r['node']}): no NCCL log line; accepted: a plugin library is mapped"
        for r in results
        if not r.get("nccl_network")
    )
    return PluginCheck(f"network plugin: every rank uses /{expect.network}/", None, unlogged)


def _plugin_problem(wrong: list[dict], expect: PreflightExpectations) -> str:
    shown = "; ".join(f"rank {r['rank']} ({r['node']}) {_network_words(r)}" for r in wrong[:3])
    more = f"; and {len(wrong) - 3} more ranks" if len(wrong) > 3 else ""
    return (
        f"network plugin not loaded: {shown}{more}; machine.preflight.network expects"
        f" /{expect.network}/ (the OFI/libfabric plugin), else NCCL carries every collective"
        f" across nodes over TCP sockets. Load the plugin (machines/{expect.machine}/README.md)"
        " or launch with preflight=false to train anyway"
    )


def _uses_plugin(result: dict, pattern: str) -> bool:
    chosen = result.get("nccl_network", "")
    if chosen:
        return re.search(pattern, chosen) is not None
    return bool(result.get("plugin_libraries"))  # no NCCL log: the mapped library is all


def _network_words(result: dict) -> str:
    if result.get("nccl_network"):
        return f"uses network {result['nccl_network']!r}"
    return "has no NCCL log line and no plugin library mapped"


def bandwidth_warnings(results: list[dict], expect: PreflightExpectations) -> list[str]:
    inside = _per_node_min(results, "intra_node_gbps")
    warnings = [
        f"node {node}: all-reduce inside the node {value:.3g} GB/s bus bandwidth, expected"
        f" >= {expect.intra_node_min_gbps:.3g} (machine.preflight.bandwidth_floor x"
        " hardware.intra_node_gbps)"
        for node, value in inside.items()
        if expect.intra_node_min_gbps > 0 and value < expect.intra_node_min_gbps
    ]
    across = _across(results)
    floor = expect.inter_node_min_gbps
    if across is not None and floor > 0 and across < floor:
        names = ", ".join(_per_node_min(results, "inter_node_gbps"))
        warnings.append(
            f"nodes {names}: all-reduce across nodes (one rank each) {across:.3g} GB/s bus"
            f" bandwidth, expected >= {expect.inter_node_min_gbps:.3g}"
            " (machine.preflight.bandwidth_floor x hardware.inter_node_gbps)"
        )
    return warnings


def _per_node_min(results: list[dict], key: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for r in results:
        if r.get(key) is not None:
            values[r["node"]] = min(values.get(r["node"], r[key]), r[key])
    return values


def _across(results: list[dict]) -> float | None:
    values = [r["inter_node_gbps"] for r in results if r.get("inter_node_gbps") is not None]
    return min(values) if values else None


def judge(
    results: list[dict], expect: PreflightExpectations, *, backend: str, job_dir: str = ""
) -> dict:
    """The verdict on every rank's numbers; the same on every rank."""
    nodes = list(dict.fromkeys(r["node"] for r in results))
    rates = {r["rank"]: r["gemm_tflops"] for r in results}
    node_of = {r["rank"]: r["node"] for r in results}
    slow = slow_ranks(rates, expect.slow_fraction, expect.gemm_min_tflops)
    slow_nodes = [n for n in nodes if any(node_of[rank] == n for rank in slow)]
    plugin = plugin_check(results, expect, backend, len(nodes))
    problems = [plugin.problem] if plugin.problem else []
    warnings = [*bandwidth_warnings(results, expect), *plugin.warnings]
    line = slow_line(slow_nodes, {f"rank {k} ({node_of[k]})": v for k, v in slow.items()})
    if slow_nodes:
        if expect.on_slow == "stop":
            problems.append(f"{line}; {STOPPED} `python -m axonn_launch.jobs resubmit {job_dir}`")
        else:
            warnings.append(line)
    return {
        "passed": not problems and not slow_nodes,
        "stopped": bool(problems),
        "slow_nodes": slow_nodes,
        "slow_ranks": {str(rank): text for rank, text in slow.items()},
        "slow_reason": line if slow_nodes else "",
        "problems": problems,
        "warnings": warnings,
        "network_check": plugin.note,
        "median_gemm_tflops": statistics.median(rates.values()),
        "gemm_clock": results[0].get("gemm_clock", "wall"),
        "gemm_tflops": {n: min(rates[k] for k in rates if node_of[k] == n) for n in nodes},
        "intra_node_gbps": _per_node_min(results, "intra_node_gbps"),
        "inter_node_gbps": _across(results),
        "network": {r["node"]: r.get("nccl_network", "") for r in results},
    }


def slow_line(slow_nodes: list[str], why: dict[str, str]) -> str:
    """``slow nodes n2: rank 2 (n2) GEMM ... < ...`` (the words ``jobs status`` shows)."""
    return f"slow nodes {', '.join(slow_nodes)}: " + "; ".join(f"{k} {v}" for k, v in why.items())


def report_lines(report: dict, expect: PreflightExpectations) -> list[str]:
    """The log lines of a verdict, rank 0's."""
    unit = "TFLOP/s per CPU second, one thread" if report["gemm_clock"] == "cpu" else "TFLOP/s"
    per_node = ", ".join(f"{n} {v:.3g}" for n, v in report["gemm_tflops"].items())
    median = report["median_gemm_tflops"]
    lines = [
        f"GEMM {expect.gemm_size}^3 {expect.gemm_dtype}: median rank {median:.3g} {unit};"
        f" slowest rank per node: {per_node}",
        "all-reduce bus bandwidth inside nodes: "
        + (", ".join(f"{n} {v:.3g} GB/s" for n, v in report["intra_node_gbps"].items()) or "-")
        + "; across nodes: "
        + (f"{report['inter_node_gbps']:.3g} GB/s" if report["inter_node_gbps"] else "-"),
        report["network_check"],
    ]
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [f"problem: {p}" for p in report["problems"]]
    return lines


# --- the whole check -------------------------------------------------------------------


def job_id_from_environment(environ: Mapping[str, str] = os.environ) -> str:
    """The id job.json records: Slurm's, or ``local-<pid of rank 0>`` on machine=local."""
    return environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"


def run_preflight(
    spec: JobSpec, env: DistEnv, startup: list[dict], environ=os.environ
) -> dict | None:
    """Measure, judge, record; raise PreflightError on every rank when the job must stop.

    Collective: every rank calls it, after ``log_startup`` (whose records it takes)."""
    if not spec.runtime.preflight:
        return None
    began = time.monotonic()
    expect = read_expectations(spec.job_dir)
    mine = measure(env, expect, startup, environ)
    log.info("preflight: this rank: %s", _rank_words(mine))
    results: list = [None] * env.world_size
    dist.all_gather_object(results, mine)
    report = judge(results, expect, backend=env.backend, job_dir=spec.job_dir)
    report["seconds"] = round(time.monotonic() - began, 2)
    if env.rank == 0:
        record(spec.job_dir, report, results, expect, environ)
    dist.barrier()  # rank 0's record is on disk before any rank stops
    if report["stopped"]:
        raise PreflightError("preflight: " + " | ".join(report["problems"]))
    return report


def _rank_words(result: dict) -> str:
    inside, across = result["intra_node_gbps"], result["inter_node_gbps"]
    return (
        f"node {result['node']}: GEMM {result['gemm_tflops']:.3g} TFLOP/s"
        + (f", all-reduce inside the node {inside:.3g} GB/s" if inside else "")
        + (f", across nodes {across:.3g} GB/s" if across else "")
        + (f", NCCL network {result['nccl_network']}" if result["nccl_network"] else "")
    )


def record(
    job_dir: str,
    report: dict,
    results: list[dict],
    expect: PreflightExpectations,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Rank 0: the log lines, ``preflight.json`` and the verdict in ``job.json``."""
    for line in report_lines(report, expect):
        (log.warning if line.startswith(("warning", "problem")) else log.info)(
            "preflight: %s", line
        )
    verdict = "stopping the job" if report["stopped"] else "passed" if report["passed"] else "done"
    log.info("preflight: %s in %.1f s", verdict, report["seconds"])
    summary = {"job_id": job_id_from_environment(environ), "host": socket.gethostname(), **report}
    full = {**summary, "expected": asdict(expect), "ranks": results}
    path = JobPaths(job_dir).preflight
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
    part.replace(path)
    if JobPaths(job_dir).record.exists():
        try:
            update_record(Path(job_dir), preflight=summary, slow_nodes=report["slow_nodes"])
        except (OSError, ValueError) as exc:  # preflight.json holds it all the same
            log.warning("preflight: could not update job.json: %s", exc)
