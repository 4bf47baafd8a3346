"""Emulated ranks (``train.emulate``): real local runs through the launcher, the
supervisor, the rendezvous on torch's TCPStore server, the watchdogs, one straggler
exchange and the checkpoint's files, with 64 ranks on 4 host processes; a host stopped
for real (SIGSTOP) is a hang that names its ranks; the store's wire client against
torch's own client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from axonn_launch.common.grid import Grid
from axonn_launch.common.spec import RuntimeConfig, TrainConfig
from axonn_launch.scheduler.processes import free_port
from axonn_launch.train.emulate.hosting import hosting, rank_environ, rendezvous_address
from axonn_launch.train.emulate.store import StoreClient
from axonn_launch.train.health.watchdog import NODE_DIR_VAR
from tests.submit.test_local_supervisor import poll

BASE = ["machine=local", "model=gpt_tiny", "train.warmup_steps=0", "train.progress=false",
        "train.gemm_tuning=false", "train.sample_tokens=0", "train.eval_batches=0",
        "train.emulate=true", "machine.host_memory_check=false"]  # fmt: skip


def launch(root: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "axonn_launch", *BASE, *overrides, "wait=true",
               f"hydra.run.dir={root}"]  # fmt: skip
    env = os.environ | {NODE_DIR_VAR: str(root.parent / "node")}  # a killed host's stays here
    return subprocess.Popen(command, cwd=root.parent, stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_64_emulated_ranks_on_4_hosts_run_to_a_clean_end(tmp_path):
    """Rendezvous, four steps, a straggler exchange at step 2, checkpoints at steps 2 and
    4 with one DCP file per rank, summary and metrics by rank 0, job.json completed."""
    root = tmp_path / "run"
    run = launch(root, "grid.data=64", "train.global_batch=64", "train.steps=4",
                 "train.emulate_host_ranks=16", "train.stragglers.every=2",
                 "train.checkpoint_every=2")  # fmt: skip
    output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output[-3000:]
    job = json.loads((root / "job.json").read_text())
    assert (job["status"], job["steps"]) == ("completed", 4), job
    summary = json.loads((root / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (4, False)
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and all(row["emulated"] for row in rows)
    hosts = sorted((root / "logs" / "emulate").glob("host_*.json"))
    records = [json.loads(path.read_text()) for path in hosts]
    assert sorted(r["ranks"][0] for r in records) == [0, 16, 32, 48]
    assert all(r["world_size"] == 64 and "rendezvous" in r["phases_s"] for r in records)
    assert "first_straggler_exchange" in summary["emulated"]["phases_s"]
    checkpoints = root / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_00000004"
    for step in ("step_00000002", "step_00000004"):
        names = {p.name for p in (checkpoints / step).iterdir()}
        assert names == {".metadata", "meta.json"} | {f"__{r}_0.distcp" for r in range(64)}
    meta = json.loads((checkpoints / "step_00000004" / "meta.json").read_text())
    assert meta["step"] == 4 and meta["real"]["bytes"] >= 120_576 * 12  # gpt_tiny, fp32 + Adam


def test_a_stopped_host_is_a_hang_that_names_its_ranks(tmp_path):
    """16 ranks on 2 hosts; the host of ranks 8-15 gets a real SIGSTOP mid-run. The other
    host's ranks wait at the step boundary until their watchdogs fire: the hang record
    names ranks 8-15, silent."""
    root = tmp_path / "run"
    run = launch(root, "grid.data=16", "train.global_batch=16", "train.steps=400",
                 "train.emulate_host_ranks=8", "train.emulate_step_s=0.05",
                 "train.watchdog.beat_s=0.25", "train.watchdog.startup_steps=1",
                 "train.watchdog.step_floor_s=2", "train.watchdog.startup_s=120")  # fmt: skip
    reader = threading.Thread(target=run.communicate, daemon=True)
    reader.start()
    log = root / "logs" / "rank_8.log"
    said = poll(lambda: log.exists() and re.search(r"in process (\d+)", log.read_text()), 120,
                "the second host")  # fmt: skip
    metrics = root / "metrics.jsonl"
    poll(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, "step 3")
    os.kill(int(said.group(1)), signal.SIGSTOP)
    reader.join(timeout=120)
    assert run.poll() is not None, "the run did not end after the hang"
    records = [json.loads(p.read_text()) for p in (root / "logs" / "failures").glob("rank_*.json")]
    hangs = [r for r in records if r.get("failure_class") == "hang"]
    assert hangs and all(r["rank"] < 8 for r in hangs), records
    named = {s["rank"] for s in hangs[0]["suspects"]}
    assert named == set(range(8, 16)) and all("section" not in s for s in hangs[0]["suspects"])
    assert json.loads((root / "job.json").read_text())["status"] == "failed"


def test_the_wire_client_speaks_with_torchs_store():
    """Keys set by either client are read by the other; add and multi_get agree."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True,
                           timeout=timedelta(seconds=30), wait_for_workers=False)  # fmt: skip
    client = StoreClient("127.0.0.1", port, 30)
    client.set("from_wire", b"1")
    server.set("from_torch", b"2")
    assert server.get("from_wire") == b"1" and client.get("from_torch") == b"2"
    assert client.multi_get(["from_torch", "from_wire"]) == [b"2", b"1"]
    assert server.add("count", 2) == 2 and client.add("count", 3) == 5
    client.close()


def test_a_task_imports_no_torch_before_it_knows_it_is_emulated():
    """The rank entry and the whole emulated path import no torch (the local warm start
    forks hosts from a process that has it; srun's tasks start bare)."""
    code = ("import sys, axonn_launch.train.__main__, axonn_launch.train.emulate;"
            " print('torch' in sys.modules)")  # fmt: skip
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert found.stdout.strip() == "False", found.stderr


def spec_of(world: int, host_ranks: int = 0) -> SimpleNamespace:
    """What hosting reads of a JobSpec: the grid, train.emulate_host_ranks, the port."""
    train = TrainConfig(emulate=True, emulate_host_ranks=host_ranks)
    return SimpleNamespace(grid=Grid(data=world), runtime=RuntimeConfig(), train=train)


SLURM = {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77",
         "SLURM_STEP_NODELIST": "n[3-4]", "SLURMD_NODENAME": "n4"}  # fmt: skip


def test_which_task_hosts_which_ranks():
    """One task per rank (Slurm, 8 per node): the node's local rank 0 hosts the node's 8
    ranks and the rest are idle; with emulate_host_ranks=4, two hosts per node. One task
    per node: each hosts its block, and each rank's variables are its own. A task count
    that does not divide the world is refused in one line."""
    task = SLURM | {"SLURM_PROCID": "8", "SLURM_LOCALID": "0"}
    host = hosting(spec_of(16), task)
    assert (host.ranks, host.node_ranks) == (tuple(range(8, 16)), 8)
    assert hosting(spec_of(16), task | {"SLURM_PROCID": "9", "SLURM_LOCALID": "1"}).ranks == ()
    four = task | {"SLURM_PROCID": "12", "SLURM_LOCALID": "4"}
    assert hosting(spec_of(16, host_ranks=4), four).ranks == (12, 13, 14, 15)
    per_node = SLURM | {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    host = hosting(spec_of(16), per_node)
    assert host.ranks == tuple(range(8, 16))
    env = rank_environ(per_node, host, 12)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"]) == ("12", "4")
    assert rendezvous_address(spec_of(16), per_node) == ("n3", 29500 + 77 % 2000)
    with pytest.raises(ValueError, match="3 tasks cannot host 16 ranks"):
        hosting(spec_of(16), SLURM | {"SLURM_NTASKS": "3", "SLURM_PROCID": "0"})
