"""Where a run's allocated time went (records/goodput.py), on timelines written by hand:
each part is checked against the arithmetic of the events, and the parts against the
allocated time."""

from __future__ import annotations

import json
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
