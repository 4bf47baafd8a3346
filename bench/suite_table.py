"""The suite's per-file table (tests and seconds per file) from pytest's ``--durations`` output.

    .venv/bin/python -m pytest --durations=0 --durations-min=0 2>&1 | tee /tmp/durations.txt
    .venv/bin/python bench/suite_table.py /tmp/durations.txt --source "CI run of <commit>"

pytest lists each phase (setup, call, teardown) of each test with its seconds; a file's
seconds are the sum over its tests' phases (module fixtures included), its test count the
tests listed. ``--durations-min=0`` lists every phase: without it pytest hides those under
5 ms, and a test all of whose phases are that short is not counted (the table says how
many phases were hidden). Under pytest-xdist the files run side by side, so the sums add
up to more than the wall time, which comes from pytest's last line. Writes
``bench/results/suite_table.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "suite_table.md"
PHASE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+?\.py)::(\S.*?)\s*$")
HIDDEN = re.compile(r"(\d+) durations? < [\d.]+s hidden")
FINAL = re.compile(r"^(?:=+ )?(.*\b(?:passed|failed|error|errors)\b.*) in ([\d.]+)s\b")


def parse(text: str) -> dict:
    """Seconds and test ids per file, hidden phases, the final line and its wall seconds."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    hidden, final, wall = 0, "", 0.0
    for line in text.splitlines():
        if m := PHASE.match(line):
            secs, _, path, test = m.groups()
            seconds[path] += float(secs)
            tests[path].add(test)
        elif m := HIDDEN.search(line):
            hidden += int(m.group(1))
        elif m := FINAL.match(line):
            final, wall = m.group(1), float(m.group(2))
    return {"seconds": dict(seconds), "tests": {k: len(v) for k, v in tests.items()},
            "hidden": hidden, "final": final, "wall": wall}  # fmt: skip


def table(parsed: dict, source: str, command: str) -> str:
    secs, counts = parsed["seconds"], parsed["tests"]
    rows = [
        "# Test suite: seconds per file",
        "",
        f"Script: bench/suite_table.py (`{command}`)",
        "",
        f"From: {source}. pytest's last line: {parsed['final'] or '(not found)'}; wall "
        f"{parsed['wall']:.0f} s. Seconds per file are the sums of its tests' setup, call and "
        "teardown (module fixtures included); under pytest-xdist files run side by side, so "
        "they add up to more than the wall time.",
    ]
    if parsed["hidden"]:
        rows.append(
            f"pytest hid {parsed['hidden']} phases under its `--durations-min`: tests whose "
            "phases were all hidden are not counted (run with `--durations-min=0`)."
        )
    rows += ["", "| file | tests | s |", "|---|---|---|"]
    for name in sorted(secs, key=lambda f: (-secs[f], f)):
        rows.append(f"| {name} | {counts[name]} | {secs[name]:.1f} |")
    rows.append(f"| **all files** | {sum(counts.values())} | {sum(secs.values()):.0f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("durations", type=Path, help="pytest's output with --durations=0")
    parser.add_argument("--source", required=True, help="which run the output is from")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    command = (
        ".venv/bin/python -m pytest --durations=0 --durations-min=0 | tee DURATIONS.txt; "
        'python bench/suite_table.py DURATIONS.txt --source "<which run>"'
    )
    args.out.write_text(table(parse(args.durations.read_text()), args.source, command))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
