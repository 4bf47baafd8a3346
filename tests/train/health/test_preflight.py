"""The preflight: fault grammar, NCCL log lines, the verdict, real gloo ranks,
the launcher's side and what ``jobs status`` / ``jobs resubmit`` make of a verdict.

The NCCL lines below are written in the format NCCL and aws-ofi-nccl print (recorded in
public threads: NVIDIA/nccl#1126 for a job on sockets, aws/aws-ofi-nccl#801 and the CSCS
documentation, eth-cscs/cscs-docs#75, for one on the libfabric plugin); there is no GPU
here to make NCCL print them. The end-to-end check on the Slurm cluster is
tests/slurm/test_preflight_on_slurm.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from axonn_launch import jobs
from axonn_launch.batch import resubmit
from axonn_launch.common import jobdir
from axonn_launch.common.grid import Grid
from axonn_launch.common.spec import JobSpec, RuntimeConfig, TrainConfig
from axonn_launch.config.compose import ConfigError, compose, load, to_launch_config
from axonn_launch.records import jobdirs, status
from axonn_launch.submit.pipeline import write_record
from axonn_launch.train.health import faults
from axonn_launch.train.health.preflight import (
    PreflightError,
    gemm_tflops,
    judge,
    plugin_check,
    run_preflight,
    slow_ranks,
)
from axonn_launch.train.health.startup import (
    enable_nccl_log,
    log_startup,
    nccl_log_path,
    nccl_networks,
)
from axonn_launch.train.parallel.bootstrap import DistEnv
from tests.conftest import run_launcher
from tests.fake_slurm import fake_tools, on_path, printing
from tests.train.dist_utils import run_world

# --- the fault grammar -------------------------------------------------------------------


def test_preflight_faults_parse_and_the_old_forms_still_do():
    assert faults.parse("slow@preflight:node=n2, slow@preflight:rank3:20, slow@preflight") == [
        faults.Fault("slow", 0, None, None, faults.PREFLIGHT, "n2"),
        faults.Fault("slow", 0, 3, 20, faults.PREFLIGHT),
        faults.Fault("slow", 0, None, None, faults.PREFLIGHT),
    ]
    assert faults.parse("collective@step5:rank1,pause@step9:node=nid001:30") == [
        faults.Fault("collective", 5, 1, None),
        faults.Fault("pause", 9, None, 30, faults.STEP, "nid001"),
    ]
    for bad in ("code@preflight", "slow@preflight:rank", "slow@preflight:node=", "slow@later"):
        with pytest.raises(ValueError, match="slow@preflight"):
            faults.parse(bad)


def test_preflight_slowdown_targets_a_rank_or_a_node_and_only_the_first_run():
    by_node = {"AXONN_FAULT": "slow@preflight:node=n2"}
    assert faults.preflight_slowdown(rank=2, node="n2", environ=by_node) == 8
    assert faults.preflight_slowdown(rank=0, node="n1", environ=by_node) == 1
    by_rank = {"AXONN_FAULT": "slow@preflight:rank1:20,pause@step1"}
    assert faults.preflight_slowdown(rank=1, node="n1", environ=by_rank) == 20
    assert faults.preflight_slowdown(rank=0, node="n1", environ=by_rank) == 1
    requeued = {**by_node, "SLURM_RESTART_COUNT": "1"}
    assert faults.preflight_slowdown(rank=2, node="n2", environ=requeued) == 1


def test_a_preflight_fault_never_fires_in_the_training_loop():
    hook = faults.step_hook(lambda: False, rank=0, start_step=0,
                            environ={"AXONN_FAULT": "slow@preflight:rank0:100"})  # fmt: skip
    assert all(hook() is False for _ in range(3))  # a step fault would sleep 100 s here


def test_a_step_fault_can_target_a_node():
    environ = {"AXONN_FAULT": "code@step1:node=n2", "SLURMD_NODENAME": "n2"}
    with pytest.raises(ValueError, match="injected code error"):
        faults.step_hook(lambda: False, rank=3, start_step=0, environ=environ)()
    environ["SLURMD_NODENAME"] = "n1"
    assert faults.step_hook(lambda: False, rank=3, start_step=0, environ=environ)() is False


# --- NCCL's log --------------------------------------------------------------------------

SOCKET_LOG = """\
nid001:702444:702444 [0] NCCL INFO Bootstrap : Using hsn0:10.100.0.1<0>
nid001:702444:702444 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal \
implementation
nid001:702444:702444 [0] NCCL INFO NET/IB : No device found.
nid001:702444:702444 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.100.0.1<0>
nid001:702444:702444 [0] NCCL INFO Using network Socket
NCCL version 2.21.5+cuda12.4
"""
OFI_LOG = """\
nid002:34610:34631 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.6.0
nid002:34610:34631 [0] NCCL INFO NET/OFI Selected Provider is cxi (found 4 nics)
nid002:34610:34631 [0] NCCL INFO Using non-device net plugin version 0
nid002:34610:34631 [0] NCCL INFO Using network AWS Libfabric
nid002:34610:34631 [0] NCCL INFO comm 0x5581 rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0
nid002:34610:34640 [0] NCCL INFO Using network AWS Libfabric
"""


def test_nccl_networks_from_log_lines():
    assert nccl_networks(SOCKET_LOG) == ["Socket"]
    assert nccl_networks(OFI_LOG) == ["AWS Libfabric"]  # once, not per communicator
    assert nccl_networks("NCCL INFO Using non-device net plugin version 0\n") == []


def test_nccl_log_goes_to_a_file_per_rank_unless_the_user_chose():
    environ: dict[str, str] = {}
    enable_nccl_log("/jobs/a", 3, environ)
    assert environ == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": "/jobs/a/logs/nccl_rank3.log",
    }
    theirs = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"}
    enable_nccl_log("/jobs/a", 3, theirs)
    assert theirs["NCCL_DEBUG"] == "WARN"
    assert nccl_log_path(theirs, 42, "nid7") == Path("/tmp/nccl.nid7.42")


# --- the verdict -------------------------------------------------------------------------

PERLMUTTER = load(["machine=perlmutter"]).machine.preflight_expectations()


def result(rank: int, node: str, tflops: float, network: str = "AWS Libfabric", **more) -> dict:
    return {"rank": rank, "node": node, "host": node, "gemm_tflops": tflops,
            "intra_node_gbps": None, "inter_node_gbps": None, "nccl_network": network,
            "plugin_libraries": [], **more}  # fmt: skip


def test_expectations_come_from_the_profile():
    assert PERLMUTTER.gemm_min_tflops == pytest.approx(0.5 * 312)
    assert (PERLMUTTER.intra_node_min_gbps, PERLMUTTER.inter_node_min_gbps) == (50, 12.5)
    assert PERLMUTTER.network == "Libfabric|OFI" and PERLMUTTER.gemm_dtype == "bf16"
    local = load(["machine=slurm_local"]).machine.preflight_expectations()
    assert (local.gemm_min_tflops, local.intra_node_min_gbps, local.network) == (0, 0, "")


def test_slow_ranks_relative_to_the_median_and_below_the_floor():
    rates = {0: 250.0, 1: 240.0, 2: 100.0, 3: 245.0}
    assert list(slow_ranks(rates, 0.5, 0)) == [2]
    assert "0.5 x the median" in slow_ranks(rates, 0.5, 0)[2]
    even = {0: 120.0, 1: 121.0}  # all equally bad: only the floor catches it
    assert slow_ranks(even, 0.5, 0) == {}
    assert "floor 156" in slow_ranks(even, 0.5, 156)[0]


def test_judge_names_the_slow_node_and_stops_or_warns():
    results = [
        result(0, "n1", 250),
        result(1, "n1", 248),
        result(2, "n2", 30),
        result(3, "n2", 249),
    ]
    report = judge(results, PERLMUTTER, backend="nccl", job_dir="/j")
    assert report["slow_nodes"] == ["n2"] and report["stopped"] and not report["passed"]
    (problem,) = report["problems"]
    assert problem.startswith("slow nodes n2: rank 2 (n2) GEMM 30 TFLOP/s")
    assert problem.endswith("python -m axonn_launch.jobs resubmit /j`")
    assert report["slow_reason"] == problem.split("; stopped")[0]
    assert report["gemm_tflops"] == {"n1": 248, "n2": 30}
    warned = judge(results, replace(PERLMUTTER, on_slow="warn"), backend="nccl")
    assert warned["slow_nodes"] == ["n2"] and not warned["stopped"] and not warned["problems"]
    assert any(w.startswith("slow nodes n2") for w in warned["warnings"])


def test_a_job_on_sockets_stops_with_one_clear_error():
    results = [
        result(0, "nid001", 250, nccl_networks(SOCKET_LOG)[0]),
        result(1, "nid002", 250, nccl_networks(OFI_LOG)[0]),
    ]
    report = judge(results, PERLMUTTER, backend="nccl")
    assert report["stopped"] and report["slow_nodes"] == []
    (problem,) = report["problems"]
    assert problem.startswith("network plugin not loaded: rank 0 (nid001) uses network 'Socket'")
    assert "/Libfabric|OFI/" in problem and "TCP sockets" in problem and "\n" not in problem
    assert "machines/perlmutter/README.md" in problem and "preflight=false" in problem


def test_plugin_check_passes_skips_and_falls_back_on_the_mapped_library():
    ofi = [result(0, "a", 1), result(1, "b", 1)]
    assert plugin_check(ofi, PERLMUTTER, "nccl", 2).problem is None
    assert "not checked (gloo" in plugin_check(ofi, PERLMUTTER, "gloo", 2).note
    sockets = [result(0, "a", 1, "Socket")]
    assert "one node" in plugin_check(sockets, PERLMUTTER, "nccl", 1).note
    assert plugin_check(sockets, replace(PERLMUTTER, network=""), "nccl", 2).problem is None
    unlogged = [result(0, "a", 1, "", plugin_libraries=["/opt/ofi/libnccl-net.so"]),
                result(1, "b", 1, "")]  # fmt: skip
    check = plugin_check(unlogged, PERLMUTTER, "nccl", 2)
    assert "rank 1 (b) has no NCCL log line and no plugin library" in check.problem
    assert "rank 0" not in check.problem
    mapped = plugin_check(unlogged[:1] + [result(1, "b", 1)], PERLMUTTER, "nccl", 2)
    assert mapped.problem is None and mapped.warnings[0].startswith("rank 0 (a): no NCCL log")


def test_low_bandwidth_warns_naming_the_nodes():
    results = [
        result(0, "n1", 250, intra_node_gbps=20.0, inter_node_gbps=4.0),
        result(1, "n1", 250, intra_node_gbps=21.0),
        result(2, "n2", 250, intra_node_gbps=90.0, inter_node_gbps=4.0),
        result(3, "n2", 250, intra_node_gbps=95.0),
    ]
    report = judge(results, PERLMUTTER, backend="nccl")
    assert report["passed"] and not report["stopped"]  # bandwidth alone never stops a job
    inside, across = report["warnings"]
    assert inside.startswith("node n1: all-reduce inside the node 20 GB/s") and "n2" not in inside
    assert across.startswith("nodes n1, n2: all-reduce across nodes (one rank each) 4 GB/s")


def test_a_gemm_doing_8x_the_work_measures_well_below_half():
    """The deliberate slowdown is 8x the work; the rule flags below 0.5x. CPU rates are
    per CPU second of the one GEMM thread, so other load on these cores does not narrow
    the 4x margin; the thread count of the process is left as it was."""
    torch.set_num_threads(2)
    normal = gemm_tflops(torch.device("cpu"), 256, torch.float32)
    slowed = gemm_tflops(torch.device("cpu"), 256, torch.float32, slowdown=8)
    assert slowed < 0.5 * normal
    assert torch.get_num_threads() == 2


# --- real gloo ranks: 4 ranks, "nodes" n1 and n2 as Slurm would name them ------------------


def preflight_worker(rank: int, world: int, spec: JobSpec) -> list:
    os.environ["SLURMD_NODENAME"] = f"n{rank // 2 + 1}"
    env = DistEnv(rank, rank % 2, world, 2, "127.0.0.1", 0, "cpu", "gloo", "torchrun")
    startup = log_startup(env)
    outcomes = [run_preflight(spec, env, startup, environ={"SLURM_JOB_ID": "77"})["passed"]]
    slowed = {"SLURM_JOB_ID": "77", "AXONN_FAULT": "slow@preflight:node=n2"}
    try:
        run_preflight(spec, env, startup, environ=slowed)
    except PreflightError as error:
        outcomes.append(str(error))
    return outcomes


def test_preflight_on_gloo_ranks_names_the_slowed_node(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"job_ids": ["77"], "status": "running"}))
    spec = JobSpec(
        name="t",
        job_dir=str(tmp_path),
        model=load([]).model,
        grid=Grid(data=1, x=2, y=1, z=2),
        train=TrainConfig(micro_batch=16),
        runtime=RuntimeConfig(preflight=True),
    )
    outcomes = run_world(preflight_worker, 4, spec, timeout=240)
    assert [o[0] for o in outcomes] == [True] * 4  # unslowed: every rank passes
    assert len({o[1] for o in outcomes}) == 1  # the same verdict on every rank
    assert outcomes[0][1].startswith("preflight: slow nodes n2: rank 2 (n2) GEMM")
    record = json.loads((tmp_path / "job.json").read_text())
    assert record["slow_nodes"] == ["n2"] and record["preflight"]["job_id"] == "77"
    assert record["preflight"]["stopped"] and "ranks" not in record["preflight"]
    full = json.loads((tmp_path / "preflight.json").read_text())
    assert [r["node"] for r in full["ranks"]] == ["n1", "n1", "n2", "n2"]
    assert all(r["intra_node_gbps"] > 0 for r in full["ranks"])  # each node measured
    assert [r["inter_node_gbps"] is not None for r in full["ranks"]] == [True, False, True, False]


# --- the launcher's side ---------------------------------------------------------------------


def test_preflight_defaults_on_for_slurm_off_for_local_and_bad_values_are_one_line(tmp_path):
    assert load(["preflight=false"]).preflight is False
    with pytest.raises(ConfigError, match=r"^preflight='maybe': expected true or false$"):
        load(["preflight=maybe"])
    with pytest.raises(ConfigError, match=r"on_slow='later': expected one of stop, warn$"):
        load(["machine.preflight.on_slow=later"])
    with pytest.raises(ConfigError, match=r"machine.preflight.network='\(': not a regular"):
        load(["machine.preflight.network='('"])
    for machine, extra, expected in [
        ("slurm_local", [], True),
        ("slurm_local", ["preflight=false"], False),
        ("local", [], False),
        ("local", ["preflight=true"], True),
    ]:
        job_dir = tmp_path / f"{machine}{len(extra)}"
        proc = run_launcher([f"machine={machine}", "dry_run=true", f"hydra.run.dir={job_dir}",
                             *extra], cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        spec = JobSpec.load(job_dir / "spec.json")
        assert spec.runtime.preflight is expected
        assert (job_dir / "preflight_expected.json").exists() is expected
        assert ("preflight  on:" in proc.stdout) is expected


def test_the_launchers_last_write_keeps_this_jobs_verdict_only(tmp_path):
    verdict = {"job_id": "5", "slow_nodes": ["n2"], "stopped": True}
    record = {"job_ids": ["5"], "status": "submitted"}
    write_record(tmp_path, dict(record))
    jobdir.update_record(tmp_path, preflight=verdict, slow_nodes=["n2"])  # the job's write
    assert write_record(tmp_path, dict(record), status="failed")["slow_nodes"] == ["n2"]
    fresh = write_record(tmp_path, {"job_ids": ["6"]}, status="submitted")  # a reused dir
    assert "slow_nodes" not in fresh and "preflight" not in fresh


# --- jobs status and resubmit ---------------------------------------------------------------


def stopped_job(root: Path, name: str, job_id: str, slow: list[str], in_record: bool) -> Path:
    job_dir = root / name
    (job_dir / "slurm" / job_id).mkdir(parents=True)
    why = f"slow nodes {', '.join(slow)}: rank 2 ({slow[0]}) GEMM ..."
    verdict = {"job_id": job_id, "slow_nodes": slow, "stopped": True, "slow_reason": why}
    command = ["axonn_launch", "machine=slurm_local", "grid.x=2", "grid.z=2"]
    record = {"name": name, "job_ids": [job_id], "machine": "slurm_local", "nodes": 2,
              "tasks_per_node": 2, "steps": 4, "status": "submitted",
              "command_line": command}  # fmt: skip
    if in_record:
        record.update(preflight=verdict, slow_nodes=slow)
    (job_dir / "job.json").write_text(json.dumps(record))
    (job_dir / "preflight.json").write_text(json.dumps({**verdict, "ranks": []}))
    err = "axonn_launch.train.health.preflight.PreflightError: preflight: slow nodes ...\n"
    (job_dir / "slurm" / job_id / f"{job_id}_0_log.err").write_text(err)
    return job_dir


def test_status_and_resubmit_of_a_job_the_preflight_stopped(tmp_path, monkeypatch, capsys):
    sacct = printing("11|FAILED|1:0|n[1-2]\n12|FAILED|1:0|n[1-2]")
    monkeypatch.setenv("PATH", on_path(fake_tools(tmp_path / "bin", {"sacct": sacct})))
    one = stopped_job(tmp_path / "jobs", "one", "11", ["n2"], in_record=True)
    two = stopped_job(tmp_path / "jobs", "two", "12", ["n1", "n2"], in_record=False)
    rows = {r.name: r for r in status.collect([str(tmp_path / "jobs")])}
    assert rows["one"].failure == "node_failure" and rows["one"].bad_nodes == ["n2"]
    assert rows["one"].reason.startswith("preflight stopped the job: slow nodes n2")
    assert rows["two"].slow_nodes == ["n1", "n2"]  # from preflight.json, folded into job.json
    assert json.loads((two / "job.json").read_text())["slow_nodes"] == ["n1", "n2"]
    assert jobs.main(["status", str(one)]) == 0
    assert "11: preflight stopped the job: slow nodes n2" in capsys.readouterr().out
    assert jobs.main(["resubmit", str(tmp_path / "jobs"), "--dry-run", "grid.z=1"]) == 0
    out = capsys.readouterr().out
    assert "+machine.slurm.extra_sbatch.exclude=n2 " in out
    assert "+machine.slurm.extra_sbatch.exclude='n1,n2' " in out  # quoted: no Hydra sweep


def test_two_excluded_nodes_compose_into_one_sbatch_value():
    override = resubmit.for_hydra("+machine.slurm.extra_sbatch.exclude=n1,n2")
    cfg = to_launch_config(compose(["machine=slurm_local", override]))
    assert cfg.machine.slurm.extra_sbatch == {"exclude": "n1,n2"}
    again = resubmit.new_overrides([override], [], ("n3",))
    assert again[0] == "+machine.slurm.extra_sbatch.exclude=n1,n2,n3"
    assert jobdirs.slow_nodes_of({"slow_nodes": ["n1", "n2;rm -rf /", "$(x)"]}) == ["n1"]


def test_nccl_warnings_in_its_log_file_still_classify_the_failure(tmp_path, monkeypatch):
    """With NCCL_DEBUG_FILE set, NCCL's WARN lines leave stderr; status reads them there."""
    sacct = printing("21|FAILED|1:0|n1")
    monkeypatch.setenv("PATH", on_path(fake_tools(tmp_path / "bin", {"sacct": sacct})))
    job_dir = tmp_path / "jobs" / "oom"
    (job_dir / "slurm" / "21").mkdir(parents=True)
    (job_dir / "logs").mkdir()
    record = {"name": "oom", "job_ids": ["21"], "nodes": 1, "tasks_per_node": 2, "steps": 4}
    (job_dir / "job.json").write_text(json.dumps(record))
    (job_dir / "slurm" / "21" / "21_0_log.err").write_text(
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356,"
        " unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    )
    assert status.collect([str(job_dir)])[0].failure == "collective_failure"
    (job_dir / "logs" / "nccl_rank0.log").write_text(
        "nid001:4242:4300 [0] NCCL INFO Using network AWS Libfabric\n"
        "nid001:4242:4300 [0] enqueue.cc:1451 NCCL WARN Cuda failure 'out of memory'\n"
    )
    assert status.collect([str(job_dir)])[0].failure == "gpu_oom"
