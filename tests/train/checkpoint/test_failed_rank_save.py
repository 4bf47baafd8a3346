"""A rank that fails while a save is in flight lets it complete first
(``Checkpointer.finish_in_flight``, called by ``train/run.py`` on a rank's error): the
save's collectives run on the checkpoint group in every rank's saving thread, so it
completes while the peer's main thread is stuck where the failed rank left it, and rank 0's
thread publishes it. A real 2-rank gloo world; the end to end case (a rank's error at
step 6 while step 4's save is in flight, resumed from step 4) is
``tests/slurm/test_faults.py::test_injected_collective_error``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from axonn_launch.train.checkpoint.manager import Checkpointer, latest_checkpoint, load_state
from axonn_launch.train.parallel.shards import Piece, ShardSpec
from tests.train.dist_utils import run_world

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def specs(rank: int) -> dict[str, ShardSpec]:
    """Row ``rank`` of a (2 x 4) tensor on each rank."""
    return {"w": ShardSpec((2, 4), (Piece(0, (rank, 0), (1, 4)),), writes=True)}


def shard(rank: int, step: int) -> torch.Tensor:
    return torch.arange(4.0) + 10 * rank + 100 * step


def _one_rank_fails_mid_save(rank: int, world: int, root: str) -> dict:
    group = dist.new_group(backend="gloo")  # the checkpoint group, as train/run.py makes
    checkpointer = Checkpointer(root, rank=rank, keep=2, group=group)
    checkpointer.save(4, {"w": shard(rank, 4)}, specs(rank), {"grid": {}})
    found: dict = {}
    if rank == 1:  # failed: no barrier, no wait() of the collective kind
        found["in_flight"] = checkpointer.finish_in_flight(60.0)
        dist.send(torch.ones(1), dst=0)  # the peer's main thread goes on when this one ends
        return found
    dist.recv(torch.zeros(1), src=1)  # stuck in the step, as a failed peer leaves it
    deadline = time.monotonic() + 30
    while latest_checkpoint(root) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # published by rank 0's saving thread, not by its main thread
    latest = latest_checkpoint(root)
    found["latest"] = latest.name if latest else None
    return found


def test_a_save_in_flight_completes_when_one_rank_fails(tmp_path):
    zero, one = run_world(_one_rank_fails_mid_save, 2, str(tmp_path), timeout=120)
    assert one["in_flight"] == ("step_00000004", "complete"), one
    assert zero["latest"] == "step_00000004", zero
    for rank in range(2):  # both ranks' rows, read here (one process, no world)
        loaded = {"w": torch.zeros(4)}
        load_state(latest_checkpoint(tmp_path), loaded, specs(rank))
        assert torch.equal(loaded["w"], shard(rank, 4)), (rank, loaded)
