"""Every table in BENCHMARKS.md names the committed script and command that produce it.

The convention: a line ``Script: <path> (`<command>`)`` between a table and the second-level
heading (``## ``) above it, in that section or in one of its subsections above the table.
``<path>`` is relative to the repository and must exist. bench/make_benchmarks_md.py
writes the line under each section's title from its list of result files.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = re.compile(r"^Script: `?([^\s`]+)`? \(`[^`]+`\)")


def unnamed_tables(text: str, root: Path) -> list[str]:
    """One line per table with no ``Script:`` line, or one naming a missing file."""
    problems, section, scripts, in_table, fenced = [], "(top)", [], False, False
    for number, line in enumerate(text.splitlines(), 1):
        fenced ^= line.startswith("```")
        if fenced or line.startswith("```"):
            continue
        if line.startswith("## "):
            section, scripts = line[3:].strip(), []
        elif m := SCRIPT.match(line):
            scripts.append(m.group(1))
        starts = line.startswith("|") and not in_table
        in_table = line.startswith("|")
        if not starts:
            continue
        if not scripts:
            problems.append(f"line {number}, section '{section}': a table names no script")
        for script in scripts:
            if not (root / script).is_file():
                problems.append(f"line {number}, section '{section}': {script} does not exist")
    return problems


def test_every_table_in_benchmarks_md_names_a_script_that_exists() -> None:
    text = (REPO / "BENCHMARKS.md").read_text()
    assert text.count("\n|---") > 20  # the tables are there to be checked
    assert unnamed_tables(text, REPO) == []


def test_a_table_naming_a_missing_script_or_none_is_found() -> None:
    text = "\n".join([
        "## Named, but missing",
        "Script: bench/no_such_bench.py (`python bench/no_such_bench.py`)",
        "| a |", "|---|", "| 1 |",
        "## Named nowhere",
        "Command: `python bench/bench_plan.py`",
        "| a |", "|---|",
        "## Named, and there",
        "Script: bench/bench_plan.py (`python bench/bench_plan.py`)",
        "### a subsection inherits it",
        "| a |", "|---|",
        "```", "| a table in a code block is not one |", "```",
    ])  # fmt: skip
    assert unnamed_tables(text, REPO) == [
        "line 3, section 'Named, but missing': bench/no_such_bench.py does not exist",
        "line 8, section 'Named nowhere': a table names no script",
    ]


def test_a_script_line_needs_its_command() -> None:
    text = "## Half named\nScript: bench/bench_plan.py\n| a |\n|---|\n"
    assert unnamed_tables(text, REPO) == ["line 3, section 'Half named': a table names no script"]


def test_the_suite_table_counts_tests_and_seconds_per_file_from_durations() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_table", REPO / "bench/suite_table.py")
    suite_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_table)
    output = "\n".join([
        "============================= slowest durations =============================",
        "12.50s call     tests/slurm/test_faults.py::test_wave[a b]",
        "0.50s setup    tests/slurm/test_faults.py::test_wave[a b]",
        "1.00s call     tests/slurm/test_faults.py::test_other",
        "0.25s call     tests/common/test_grid.py::TestGrid::test_coords",
        "(3 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "======= 3 passed, 1 skipped in 20.40s (0:00:20) =======",
    ])  # fmt: skip
    parsed = suite_table.parse(output)
    assert parsed["seconds"] == {"tests/slurm/test_faults.py": 14.0,
                                 "tests/common/test_grid.py": 0.25}  # fmt: skip
    assert parsed["tests"] == {"tests/slurm/test_faults.py": 2, "tests/common/test_grid.py": 1}
    assert (parsed["hidden"], parsed["wall"]) == (3, 20.4)
    table = suite_table.table(parsed, "a test", "python bench/suite_table.py x --source y")
    assert "| tests/slurm/test_faults.py | 2 | 14.0 |" in table
    assert "| **all files** | 3 | 14 |" in table
    assert "pytest hid 3 phases" in table
    assert unnamed_tables("#" + table, REPO) == []
