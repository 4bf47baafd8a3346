"""The first failing rank is named from the records the ranks leave (records/firstfail.py)."""

from __future__ import annotations

import json

from axonn_launch.common import jobdir
from axonn_launch.records import firstfail


def fail(job_dir, rank: int, error: BaseException) -> None:
    try:
        raise error
    except BaseException as caught:
        jobdir.record_failure(job_dir, rank, caught)


def test_the_cause_wins_over_earlier_lost_peer_symptoms(tmp_path):
    lost = "[pair.cc:553] Connection closed by peer [127.0.0.1]:43756"
    fail(tmp_path, 0, RuntimeError(lost))
    fail(tmp_path, 3, RuntimeError(lost))
    fail(tmp_path, 1, ValueError("seq_len=128 > max_seq_len=64"))
    # rank 0's symptom was written first; the cause is still rank 1's
    first = firstfail.first_failure(tmp_path)
    assert first["rank"] == 1
    assert firstfail.headline(first).endswith(
        "failed first: ValueError: seq_len=128 > max_seq_len=64"
    )
    last = firstfail.describe(first).splitlines()[-1]
    assert last == "  ValueError: seq_len=128 > max_seq_len=64"


def test_only_symptoms_name_the_earliest(tmp_path):
    for rank in (2, 0):
        fail(tmp_path, rank, RuntimeError("Connection reset by peer"))
    assert firstfail.first_failure(tmp_path)["rank"] == 2


def test_no_records_and_unreadable_records(tmp_path):
    assert firstfail.first_failure(tmp_path) is None
    folder = jobdir.JobPaths(tmp_path).failures
    folder.mkdir(parents=True)
    (folder / "rank_5.json").write_text("{truncated")
    assert firstfail.first_failure(tmp_path) is None
    fail(tmp_path, 4, KeyError("wte.weight"))
    record = json.loads((folder / "rank_4.json").read_text())
    assert record["exception"] == "KeyError: 'wte.weight'" and record["host"]


def test_two_threads_of_one_rank_recording_at_once_leave_one_whole_record(tmp_path):
    """A rank's watchdog thread and its main thread can both record the rank's failure at
    the same moment (a rank stopped with SIGSTOP and let go by Slurm's SIGCONT before its
    SIGTERM: its watchdog fires while its main thread's collective fails). Each write
    goes through a file of its own thread; a shared one left one record's text followed by
    the tail of the other's, which no reader could parse."""
    import threading

    rounds, writers = 200, 2
    for round_ in range(rounds):
        barrier = threading.Barrier(writers)

        def write(i: int, barrier=barrier, round_=round_) -> None:
            barrier.wait()
            message = ("x" * 150 * (i + 1)) + f" {round_}"  # records of different lengths
            fail(tmp_path, 3, RuntimeError(message))

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        record = json.loads(jobdir.JobPaths(tmp_path).failure_record(3).read_text())
        assert record["exception"].endswith(f" {round_}"), (round_, record["exception"][-20:])
    leftovers = [p.name for p in jobdir.JobPaths(tmp_path).failures.iterdir()]
    assert leftovers == ["rank_3.json"], leftovers
