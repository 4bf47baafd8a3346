"""Where the test suite's time goes: seconds per test file, from pytest's JUnit XML.

    AXONN_START_SLURM=1 .venv/bin/python -m pytest --junitxml=/tmp/after.xml
    python bench/suite_times.py /tmp/after.xml [--before /tmp/before.xml] [--wall-after S]

Each test's time is pytest's (setup, call and teardown together), so a file's sum holds its
module fixtures too. Under pytest-xdist the files run side by side on the workers, so the
sums add up to more than the wall time; the wall time of the whole run is the XML's own
(or ``--wall-*``, when the run's wall clock was measured outside pytest). Writes
``bench/results/suite_times.md``.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "suite_times.md"


def per_file(xml_path: Path) -> tuple[dict[str, float], dict[str, int], float]:
    """(seconds per file, tests per file, the run's wall time) from one JUnit XML."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in root.iter("testcase"):
        name = file_of(case.get("classname", ""))
        seconds[name] += float(case.get("time", 0) or 0)
        counts[name] += 1
    wall = sum(float(s.get("time", 0) or 0) for s in suites)
    return dict(seconds), dict(counts), wall


def file_of(classname: str) -> str:
    """``tests.slurm.test_faults`` or ``tests.test_x.TestY`` -> ``tests/slurm/test_faults.py``."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py"
    return "/".join(parts) + ".py"


def table(after: Path, before: Path | None, wall_after: float, wall_before: float) -> str:
    secs, counts, xml_wall = per_file(after)
    b_secs, b_counts, b_wall = per_file(before) if before else ({}, {}, 0.0)
    wall_after = wall_after or xml_wall
    wall_before = wall_before or b_wall
    files = sorted(set(secs) | set(b_secs), key=lambda f: -max(secs.get(f, 0), b_secs.get(f, 0)))
    rows = [
        "## Test suite: where the time goes",
        "",
        "Command: `python bench/suite_times.py AFTER.xml --before BEFORE.xml` over the JUnit "
        "XML of two full runs of the README's test command (`--junitxml=...` added). "
        "Seconds per file are pytest's (setup + call + teardown, module fixtures included); "
        "under pytest-xdist the files run side by side, so they add up to more than the wall "
        "time.",
        "",
        f"Wall time of the whole run: before {wall_before:.0f} s, after {wall_after:.0f} s. "
        f"Tests: before {sum(b_counts.values())}, after {sum(counts.values())}.",
        "",
        "| file | tests before | s before | tests after | s after |",
        "|---|---|---|---|---|",
    ]
    for name in files:
        rows.append(
            f"| {name} | {b_counts.get(name, '')} | {fmt(b_secs.get(name))} | "
            f"{counts.get(name, '')} | {fmt(secs.get(name))} |"
        )
    rows.append(
        f"| **all files** | {sum(b_counts.values())} | {sum(b_secs.values()):.0f} | "
        f"{sum(counts.values())} | {sum(secs.values()):.0f} |"
    )
    return "\n".join(rows) + "\n"


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("after", type=Path)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--wall-after", type=float, default=0.0)
    parser.add_argument("--wall-before", type=float, default=0.0)
    args = parser.parse_args()
    RESULTS.write_text(table(args.after, args.before, args.wall_after, args.wall_before))
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
