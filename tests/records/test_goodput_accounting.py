"""Where a run's allocated time went (records/goodput.py), on timelines written by hand:
each part is checked against the arithmetic of the events, and the parts against the
allocated time."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths, append_timeline, read_timeline
from axonn_launch.records.goodput import PARTS, Allocation, describe, of_run


def attempt(folder: Path, events: list[tuple[str, int, float, float]]) -> Path:
    folder.mkdir()
    for kind, step, start, end in events:
        append_timeline(folder, {kind: step, "start": start, "end": end})
    return folder


def total(found) -> float:
    return sum(getattr(found, f"{part}_s") for part in PARTS)


def test_a_run_healed_once(tmp_path):
    # attempt 1: allocated 100..160; start-up 10 s; steps 1-4 of 10 s with a 2 s save after
    # step 2; killed after step 4 (its steps 3 and 4 are redone), ended 6 s later
    one = attempt(tmp_path / "a1", [
        ("step", 1, 110, 120), ("step", 2, 120, 130), ("checkpoint", 2, 130, 132),
        ("step", 3, 132, 142), ("step", 4, 142, 154),
    ])  # fmt: skip
    # attempt 2: queued 160..170 (submitted at 165), start-up 15 s, steps 3-4 again, a
    # final save, 3 s to the end
    two = attempt(tmp_path / "a2", [
        ("step", 3, 185, 195), ("step", 4, 195, 205), ("checkpoint", 4, 206, 209),
    ])  # fmt: skip
    found = of_run([Allocation(one, 100, 100, 160), Allocation(two, 165, 170, 212)], True)
    assert found.allocated_s == 60 + 42
    assert found.startup_s == 10 + 3  # and the finished run's 3 s after its last save
    assert found.useful_s == 10 + 10 + 10 + 10  # steps 1, 2 (first) and 3, 4 (second)
    assert found.lost_s == 10 + 12 and found.lost_steps == 2
    assert found.checkpoint_s == 2 + (1 + 3)  # the gap before a save is the save's
    assert found.recovery_s == 6 + 15  # the failed attempt's tail, the next one's start-up
    assert total(found) == pytest.approx(found.allocated_s)
    assert found.queue_s == 5
    assert found.ttr_s == [185 - 160]
    assert found.goodput == pytest.approx(40 / 102)


def test_a_stopped_run_loses_what_its_last_attempt_did_after_its_last_save(tmp_path):
    only = attempt(tmp_path / "a1", [
        ("step", 1, 1, 2), ("checkpoint", 1, 2, 3), ("step", 2, 3, 4), ("step", 3, 4, 5),
    ])  # fmt: skip
    found = of_run([Allocation(only, 0, 0, 6)], finished=False)
    assert (found.useful_s, found.lost_s, found.lost_steps) == (1, 2, 2)
    assert (found.startup_s, found.checkpoint_s, found.recovery_s) == (1, 1, 1)
    assert total(found) == found.allocated_s == 6


def test_a_fallback_to_an_older_checkpoint_loses_the_steps_after_it(tmp_path):
    # the newest save (step 4) was damaged: attempt 2 resumes from step 2
    one = attempt(tmp_path / "a1", [("step", s, s, s + 1) for s in range(1, 6)])
    two = attempt(tmp_path / "a2", [("step", s, 20 + s, 21 + s) for s in range(3, 6)])
    found = of_run([Allocation(one, 0, 0, 7), Allocation(two, 7, 10, 27)], True)
    assert found.lost_steps == 3  # steps 3, 4 and 5 of attempt 1
    assert found.useful_s == 2 + 3


def test_events_outside_the_allocation_are_clipped(tmp_path):
    skewed = attempt(tmp_path / "a1", [("step", 1, -5, 3), ("step", 2, 3, 12)])
    found = of_run([Allocation(skewed, 0, 0, 10)], True)
    assert found.useful_s == 10 and total(found) == found.allocated_s == 10


def test_no_timeline_no_goodput(tmp_path):
    (tmp_path / "a1").mkdir()
    assert of_run([Allocation(tmp_path / "a1", 0, 0, 10)], True) is None


def test_a_line_cut_off_by_a_crash_is_left_out(tmp_path):
    folder = attempt(tmp_path / "a1", [("step", 1, 0, 1)])
    with open(JobPaths(folder).timeline, "a") as handle:
        handle.write(json.dumps({"step": 2, "start": 1, "end": 2})[:20])
    assert read_timeline(folder) == [{"step": 1, "start": 0, "end": 1}]


def test_the_line_names_every_part(tmp_path):
    one = attempt(tmp_path / "a1", [("step", 1, 1, 2), ("step", 2, 2, 3)])
    two = attempt(tmp_path / "a2", [("step", 2, 12, 13)])
    line = describe(of_run([Allocation(one, 0, 0, 4), Allocation(two, 5, 10, 14)], True).as_dict())
    assert line.startswith("goodput 25% of 8 s allocated: useful 2 s, lost 1 s (1 steps)")
    for word in ("start-up", "checkpoint", "recovery", "queued 5 s"):
        assert word in line, line
    assert line.endswith("time to recovery 8 s")


# --- stalls and requeued allocations --------------------------------------------------------


def hang_record(folder: Path, at: float, stalled_s: float) -> None:
    """What a rank's watchdog writes when a section made no progress for ``stalled_s``."""
    JobPaths(folder).failures.mkdir(parents=True, exist_ok=True)
    record = {"rank": 1, "host": "n1", "time": at, "exception": "Hang: ...", "step": 4,
              "failure_class": "hang", "section": "compute", "stalled_s": stalled_s}  # fmt: skip
    (JobPaths(folder).failures / "rank_1.json").write_text(json.dumps(record))


def test_a_hang_is_lost_from_its_section_start_to_the_allocations_end(tmp_path):
    # attempt 1: steps 1-3 of 1 s, a save after step 2; step 4 hung from 14 (the watchdog
    # fired at 54 after 40 s), the allocation ended at 60; attempt 2 redoes step 3 on
    one = attempt(tmp_path / "a1", [
        ("step", 1, 10, 11), ("step", 2, 11, 12), ("checkpoint", 2, 12, 13),
        ("step", 3, 13, 14),
    ])  # fmt: skip
    hang_record(one, at=54, stalled_s=40)
    two = attempt(tmp_path / "a2", [("step", s, 70 + s, 71 + s) for s in (3, 4, 5)])
    found = of_run([Allocation(one, 0, 0, 60), Allocation(two, 62, 65, 78)], True)
    assert found.stalled_s == 60 - 14
    assert found.lost_s == 1 + 46 and found.lost_steps == 1  # step 3, then the stall
    assert found.recovery_s == 0 + 8  # nothing after the hang began; attempt 2's start-up
    assert found.useful_s == 2 + 3
    assert total(found) == pytest.approx(found.allocated_s) == 60 + 13
    assert "lost 47 s (1 steps; 46 s stalled)" in describe(found.as_dict())


def test_a_step_ten_times_the_median_is_a_stall_beyond_the_median(tmp_path):
    """A rank stopped for 735 s then went on: the step is kept (useful, as long as the
    median step), the rest is lost; slow first steps and evaluating steps are not."""
    steps = [("step", 1, 0, 5), ("step", 2, 5, 8)]  # warm-up: slow, never a stall
    steps += [("step", s, 8 + s, 9 + s) for s in range(3, 8)]  # 1 s each: 11..16
    steps += [("step", 8, 16, 751), ("step", 9, 751, 752), ("step", 10, 752, 772)]
    only = attempt(tmp_path / "a1", steps)
    JobPaths(only).metrics.write_text(json.dumps({"step": 10, "loss": 1.0, "val_loss": 2.0}))
    found = of_run([Allocation(only, 0, 0, 772)], True)
    assert found.stalled_s == 735 - 1 and found.lost_s == found.stalled_s
    assert found.useful_s == 772 - 734  # step 10 (20 s) evaluated: all of it useful
    assert total(found) == pytest.approx(found.allocated_s)


SACCT_D = """\
812|REQUEUED|0:0|n1|2026-12-04T10:00:00|2026-12-04T10:00:10|2026-12-04T10:10:10
812|COMPLETED|0:0|n2|2026-12-04T10:10:10|2026-12-04T10:10:40|2026-12-04T10:15:40
"""


def test_every_allocation_of_a_requeued_job_counts(tmp_path):
    """sacct -D: a job requeued in place (one job dir) ran twice; the first allocation is
    allocated time (its steps after the last save lost), not queue time."""
    from axonn_launch.scheduler.slurm_queries import sacct_infos

    (first, second) = sacct_infos(SACCT_D)["812"].allocations
    t0 = first[1]  # the first allocation's start
    events = [("step", s, t0 + 10 * s, t0 + 10 * s + 10) for s in range(1, 6)]
    events.insert(3, ("checkpoint", 3, t0 + 40, t0 + 41))
    events += [("step", s, second[1] + 10 * (s - 3), second[1] + 10 * (s - 3) + 10)
               for s in range(4, 11)]  # fmt: skip
    folder = attempt(tmp_path / "a1", sorted(events, key=lambda e: e[2]))
    found = of_run([Allocation(folder, *first), Allocation(folder, *second)], True)
    assert found.allocated_s == 600 + 300
    assert found.queue_s == 10 + 30  # each allocation's own wait
    assert found.lost_steps == 2  # steps 4 and 5 ran again in the second allocation
    assert total(found) == pytest.approx(found.allocated_s)
    kept_submit = Allocation(folder, first[0], *second[1:])  # a Slurm that keeps the submit
    again = of_run([Allocation(folder, *first), kept_submit], True)
    assert again.queue_s == found.queue_s and again.allocated_s == found.allocated_s


def test_node_hours_count_each_allocation_s_nodes_and_time_not_the_queue(tmp_path):
    """A 4-node attempt of 1 h 30 min, then a shrunk 2-node one of 30 min after 10 min in
    the queue: 4 x 1.5 + 2 x 0.5 = 7 node-hours, beside the allocated time."""
    one = attempt(tmp_path / "a1", [("step", 1, 60, 120)])
    two = attempt(tmp_path / "a2", [("step", 2, 6060, 6120)])
    found = of_run(
        [Allocation(one, 0, 0, 5400, nodes=4), Allocation(two, 5400, 6000, 7800, nodes=2)], True
    ).as_dict()
    assert found["node_hours"] == pytest.approx(7.0)
    assert describe(found).startswith("goodput 2% of 2.0 h allocated (7 node-hours): ")


def test_an_ended_run_s_goodput_is_written_beside_its_curves_once_per_last_step(tmp_path):
    from axonn_launch.records.curves import log_goodput
    from tests.train.tracker_files import tb_series

    (tmp_path / "tensorboard").mkdir()
    found = {"goodput": 0.5, "useful_s": 10.0, "queue_s": 3.0, "node_hours": 0.25}
    assert log_goodput(tmp_path, found, 8) == ""
    assert log_goodput(tmp_path, {**found, "goodput": 0.9}, 8) == ""  # held already: no write
    assert tb_series(tmp_path / "tensorboard", "goodput/goodput") == [(8, 0.5)]
    assert log_goodput(tmp_path, {**found, "goodput": 0.75}, 12) == ""  # extended since
    assert tb_series(tmp_path / "tensorboard", "goodput/goodput") == [(8, 0.5), (12, 0.75)]
    assert tb_series(tmp_path / "tensorboard", "goodput/node_hours") == [(8, 0.25), (12, 0.25)]
    assert log_goodput(tmp_path / "no_curves", found, 8) == ""  # a run without the sink
    assert not (tmp_path / "no_curves").exists()


def test_a_local_job_ends_when_its_supervisor_said_not_at_the_whole_second(tmp_path):
    """A local job's allocation ends at job.json's ``ended_at``. ``ended`` alone (whole
    seconds) put the end of a job whose steps all ran inside its last second before them,
    and none of its time was useful (a CI run's ``useful_s == 0``)."""
    from axonn_launch.batch.supervise import end_fields
    from axonn_launch.records.status import allocation_of

    fields = end_fields()
    at = fields["ended_at"]
    assert datetime.strptime(fields["ended"], "%Y-%m-%dT%H:%M:%S%z").timestamp() == int(at)
    second = float(int(at))
    record = {"job_ids": ["local-1"], "submitted_at": second - 5.0, "ended": fields["ended"]}
    assert allocation_of(record, None) == [second - 5.0, second - 5.0, second]  # as before
    record["ended_at"] = second + 0.9
    allocation = allocation_of(record, None)
    assert allocation == [second - 5.0, second - 5.0, second + 0.9]
    steps = attempt(tmp_path / "a1", [("step", 1, second + 0.1, second + 0.5),
                                      ("step", 2, second + 0.5, second + 0.8)])  # fmt: skip
    found = of_run([Allocation(steps, *allocation)], True)
    assert found.useful_s == pytest.approx(0.7) and total(found) == pytest.approx(5.9)
