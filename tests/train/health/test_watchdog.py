"""The watchdog's rules (deadlines, who is named, the straggler score) and one watchdog
firing for real in this process: a thread that stops making progress, another rank
that answers and one that stays silent. No subprocess; well under a second."""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.spec import StragglerConfig, WatchdogConfig
from axonn_launch.train.health import watchdog
from axonn_launch.train.health.faults import parse, poisons
from axonn_launch.train.health.watchdog import (
    HANG_EXIT,
    NODE_DIR_VAR,
    Watchdog,
    checkpoint_deadline,
    collective_timeout,
    find_suspects,
    step_deadline,
    straggler_report,
    straggler_scores,
)

CFG = WatchdogConfig(startup_s=900, startup_steps=2, step_factor=10, step_floor_s=120)


@pytest.fixture(autouse=True)
def node_dir(tmp_path, monkeypatch):
    """The node-local folders of these watchdogs (a fired one is never stopped) in tmp."""
    monkeypatch.setenv(NODE_DIR_VAR, str(tmp_path / "node"))


def test_the_first_steps_get_the_start_up_grace():
    assert step_deadline(CFG, [], 0) == 900
    assert step_deadline(CFG, [30.0], 1) == 900


def test_then_a_multiple_of_the_median_step_with_a_floor():
    assert step_deadline(CFG, [30.0, 20.0, 500.0], 3) == 300  # median 30 s, not the outlier
    assert step_deadline(CFG, [0.1, 0.2, 0.1], 3) == 120  # the floor


def test_a_save_gets_its_bytes_at_the_file_systems_bandwidth():
    cfg = WatchdogConfig(checkpoint_gbps=1.0, checkpoint_factor=4, checkpoint_floor_s=120)
    assert checkpoint_deadline(cfg, 50e9) == pytest.approx(120 + 4 * 50)
    assert checkpoint_deadline(WatchdogConfig(checkpoint_gbps=0), 50e9) == 120  # unknown: floor


def test_collectives_time_out_after_the_watchdog_speaks():
    assert collective_timeout(CFG, 120) == 360
    assert collective_timeout(WatchdogConfig(collective_factor=0), 120) is None


def beat(step: int, section: str, at: float) -> dict:
    return {"step": step, "section": section, "beat": at, "answered": at, "node": "n1"}


def test_a_silent_rank_is_named_alone():
    """Rank 2 did not answer; rank 1, blocked in a collective with it, is behind rank 0
    and must not be named."""
    beats = {0: beat(7, "sync", 10), 1: beat(7, "compute", 10), 2: beat(0, "init", 1), 3: None}
    assert find_suspects(beats, asked_at=5) == [2, 3]


def test_when_all_answer_the_ranks_furthest_behind_are_named():
    beats = {0: beat(7, "sync", 10), 1: beat(7, "compute", 10), 2: beat(7, "sync", 10)}
    assert find_suspects(beats, asked_at=5) == [1]


def test_all_at_the_same_point_names_no_one():
    beats = {r: beat(7, "sync", 10) for r in range(4)}
    assert find_suspects(beats, asked_at=5) == []


def test_one_slow_rank_of_four_is_a_straggler():
    times = [0.10, 0.101, 0.099, 0.30]
    report = straggler_report(times, ["n1", "n1", "n2", "n2"], StragglerConfig(), step=50)
    (named,) = report["stragglers"]
    assert (named["rank"], named["node"], named["ratio"]) == (3, "n2", 3.0)
    assert report["median_s"] == pytest.approx(0.1005)


def test_one_slow_rank_of_two_is_named_against_the_other():
    report = straggler_report([0.1, 0.2], ["n1", "n2"], StragglerConfig(), step=5)
    assert [s["rank"] for s in report["stragglers"]] == [1]


def test_noise_and_a_small_excess_name_no_one():
    times = [0.100, 0.103, 0.098, 0.101, 0.099, 0.102, 0.100, 0.104, 0.140]
    assert straggler_report(times, ["n"] * 9, StragglerConfig(), step=1)["stragglers"] == []
    _, scored = straggler_scores([0.1] * 16)
    assert all(score == 0 for _, score in scored)  # equal times: no division by a zero MAD


def test_a_large_world_uses_the_median_of_all():
    times = [0.1] * 1000 + [0.5]
    report = straggler_report(times, ["n"] * 1001, StragglerConfig(), step=1)
    assert [s["rank"] for s in report["stragglers"]] == [1000]


def test_fault_kinds_of_the_watchdog_tests():
    kinds = [f.kind for f in parse("hang@step5:rank1,straggle@step2:rank3:300,nan_grad@step4")]
    assert kinds == ["hang", "straggle", "nan_grad"]
    env = {"AXONN_FAULT": "nan_loss@step5:rank1:attempt1,nan_grad@step7:rank0"}
    assert poisons(rank=1, attempt=1, environ=env) == {5: "nan_loss"}
    assert poisons(rank=1, attempt=2, environ=env) == {}
    assert poisons(rank=0, attempt=2, environ=env) == {7: "nan_grad"}


def test_a_watchdog_fires_names_the_silent_rank_and_collects_the_stacks(tmp_path):
    """Rank 0 stops making progress in step 3; rank 1's watchdog is alive and answers (its
    stacks are dumped); rank 2 never answers. Rank 0's record names rank 2 and its node."""
    paths = JobPaths(tmp_path)
    cfg = WatchdogConfig(beat_s=0.05, step_floor_s=0.3)
    ended = threading.Event()
    codes = []

    def end(code: int) -> None:
        codes.append(code)
        ended.set()

    peer = Watchdog(cfg, tmp_path, rank=1, world_size=3, node="n1").start()
    peer.enter("sync", 3, 60)
    silent = Watchdog(cfg, tmp_path, rank=2, world_size=3, node="n2")
    silent.write_heartbeat()  # at start-up only, as a stopped process leaves it
    dog = Watchdog(cfg, tmp_path, rank=0, world_size=3, node="n1", end=end).start()
    dog.enter("data", 3, 0.3)
    dog.mark("compute")
    started = time.time()
    assert ended.wait(10)
    peer.stop()
    assert codes == [HANG_EXIT] and time.time() - started < 5
    record = json.loads((paths.failures / "rank_0.json").read_text())
    assert record["failure_class"] == "hang"
    assert (record["section"], record["step"]) == ("compute", 3)
    assert record["suspects"] == [{"rank": 2, "node": "n2"}]
    assert "without progress: rank 2 (n2), silent" in record["exception"]
    assert "in section compute of step 3" in paths.stack_dump(0).read_text()
    assert "in section sync of step 3" in paths.stack_dump(1).read_text()
    assert "Thread" in paths.stack_dump(1).read_text()  # faulthandler's dump of every thread
    assert not paths.stack_dump(2).exists()


def test_ranks_all_alive_at_the_same_point_get_one_more_deadline(tmp_path):
    """Both ranks sit in step 4's sync past the 0.3 s deadline and both answer: slow, not
    silent. Rank 0's watchdog waits a second deadline, then records a hang naming no one."""
    paths = JobPaths(tmp_path)
    cfg = WatchdogConfig(beat_s=0.05, step_floor_s=0.3)
    ended = threading.Event()
    peer = Watchdog(cfg, tmp_path, rank=1, world_size=2, node="n2").start()
    peer.enter("sync", 4, 60)
    dog = Watchdog(cfg, tmp_path, rank=0, world_size=2, node="n1", end=lambda c: ended.set())
    dog.start().enter("sync", 4, 0.3)
    started = time.time()
    assert ended.wait(10)
    waited = time.time() - started
    peer.stop()
    assert waited > 2 * 0.3, waited
    assert dog.graced_since == dog.section.since
    record = json.loads((paths.failures / "rank_0.json").read_text())
    assert record["suspects"] == [] and "none named" in record["exception"]


def fire_together(tmp_path, ranks: int, readers: collections.Counter, monkeypatch) -> list[dict]:
    """``ranks`` watchdogs (two per node) pass step 5's sync deadline together; one more
    rank is silent. Each heartbeat read is counted by the rank that reads it. Their
    failure records, once every one has fired."""
    real = Watchdog.read_beat

    def counted(self, rank: int):
        readers[self.rank] += 1
        return real(self, rank)

    monkeypatch.setattr(Watchdog, "read_beat", counted)
    cfg = WatchdogConfig(beat_s=0.05, step_floor_s=0.3)
    ended = threading.Semaphore(0)
    silent = Watchdog(cfg, tmp_path, rank=ranks, world_size=ranks + 1, node="nx")
    silent.write_heartbeat()
    dogs = [Watchdog(cfg, tmp_path, rank=r, world_size=ranks + 1, node=f"n{r // 2}",
                     end=lambda code: ended.release()) for r in range(ranks)]  # fmt: skip
    for dog in dogs:
        dog.start().enter("sync", 5, 0.3)
    fired = sum(ended.acquire(timeout=20) for _ in dogs)
    for dog in dogs:
        dog.stopping.set()
    assert fired == ranks
    paths = JobPaths(tmp_path)
    return [json.loads(paths.failure_record(r).read_text()) for r in range(ranks)]


def test_of_ranks_firing_together_one_reads_the_heartbeats_and_all_name_the_same(
    tmp_path, monkeypatch
):
    """Six ranks fire at once and a seventh is silent: the first to claim the collection
    reads the heartbeats, the other five take its verdict (O(ranks) reads of the shared
    file system in a hang, not O(ranks^2)). Every record names the silent rank."""
    readers: collections.Counter = collections.Counter()
    records = fire_together(tmp_path, 6, readers, monkeypatch)
    assert all(r["suspects"] == [{"rank": 6, "node": "nx"}] for r in records), records
    (collector,) = {r["collected_by"] for r in records}
    assert list(readers) == [collector], readers  # no other rank read a heartbeat
    assert readers[collector] >= 7  # every rank's, the silent one's more than once
    assert not JobPaths(tmp_path).hang_collector.exists()  # released for the next hang


def test_a_collector_that_gives_no_verdict_is_replaced_by_each_waiting_rank(tmp_path, monkeypatch):
    """A claim made just now by a rank that never publishes (it died collecting): each
    firing rank waits a collection's time (its margin shortened here), then reads the
    heartbeats itself and still names the silent rank. A claim older than a collection is
    an earlier hang's: the next firing rank takes it over at once."""
    monkeypatch.setattr(watchdog, "COLLECT_MARGIN_S", 0.5)
    paths = JobPaths(tmp_path)
    paths.hang_collector.parent.mkdir(parents=True)
    paths.hang_collector.touch()
    readers: collections.Counter = collections.Counter()
    records = fire_together(tmp_path, 2, readers, monkeypatch)
    assert sorted(r["collected_by"] for r in records) == [0, 1] == sorted(readers)
    assert all(r["suspects"] == [{"rank": 2, "node": "nx"}] for r in records)
    stale = time.time() - 3600
    paths.hang_collector.touch()
    os.utime(paths.hang_collector, (stale, stale))
    paths.hang_verdict.unlink()
    readers.clear()
    began = time.time()
    records = fire_together(tmp_path / "again", 1, readers, monkeypatch)
    assert records[0]["collected_by"] == 0 and time.time() - began < 3


def answers(paths: JobPaths, ranks: list[int], asked: float, timeout: float = 5) -> list[dict]:
    """The heartbeats of ``ranks`` once all answered the request of ``asked`` (or timed out)."""
    deadline = time.time() + timeout
    while True:
        beats = [json.loads(paths.heartbeat(r).read_text()) for r in ranks]
        if all(b["answered"] >= asked for b in beats) or time.time() > deadline:
            return beats
        time.sleep(0.02)


def test_one_rank_of_a_node_relays_the_request_and_another_takes_over_when_it_stops(tmp_path):
    """Four ranks of node n1 and one of n2 beat every 0.05 s; a request on the shared file
    system reaches each through its node's relayed copy, and each answers it. The rank
    that relays n1's (the stamp names it) then stops as a SIGSTOP would stop it: another
    rank of n1 takes over, and the next request reaches the other three. Stopping the
    watchdogs leaves no node-local folder behind."""
    paths = JobPaths(tmp_path)
    cfg = WatchdogConfig(beat_s=0.05)
    nodes = ["n1"] * 4 + ["n2"]
    dogs = [
        Watchdog(cfg, tmp_path, rank=r, world_size=5, node=n).start() for r, n in enumerate(nodes)
    ]
    folders = {dog.relay.folder for dog in dogs}
    paths.hang_request.touch()
    asked = paths.hang_request.stat().st_mtime
    assert all(b["answered"] == asked for b in answers(paths, list(range(5)), asked))
    assert len(folders) == 2 and all(f.exists() for f in folders)
    stamp = dogs[0].relay.stamp.stat().st_mtime_ns
    (relay,) = [dog for dog in dogs[:4] if dog.relay.stamped_ns == stamp]
    relay.stopping.set()  # stopped: no beat, no relay, no answer
    relay.thread.join()
    time.sleep(0.1)
    os.utime(paths.hang_request, (asked + 1, asked + 1))
    others = [dog.rank for dog in dogs[:4] if dog is not relay]
    assert all(b["answered"] == asked + 1 for b in answers(paths, others, asked + 1))
    assert json.loads(paths.heartbeat(relay.rank).read_text())["answered"] == asked
    for dog in dogs:
        dog.stop()
    assert not any(f.exists() for f in folders)


def test_a_rank_that_cannot_use_its_node_folder_looks_at_the_shared_request(tmp_path, monkeypatch):
    """The node-local folder cannot be made (its parent is a file): the rank says so once
    and answers the shared request itself, at its beat."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(NODE_DIR_VAR, str(tmp_path / "file"))
    paths = JobPaths(tmp_path / "job")
    dog = Watchdog(WatchdogConfig(beat_s=0.05), tmp_path / "job", rank=0, world_size=1, node="n1")
    dog.start()
    paths.hang_request.touch()
    asked = paths.hang_request.stat().st_mtime
    (beat,) = answers(paths, [0], asked)
    dog.stop()
    assert beat["answered"] == asked and dog.relay.direct
