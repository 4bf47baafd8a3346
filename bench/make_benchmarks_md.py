"""Assemble BENCHMARKS.md from the result files the benchmarks write in bench/results/.

    python bench/make_benchmarks_md.py

Each section is the verbatim output of one benchmark, with a ``Script:`` line naming the
committed script and command that produce it.
"""

from pathlib import Path

HERE = Path(__file__).parent
# (result file, area, the script that makes it, its command). Each section gets a line
# ``Script: <script> (`<command>`)`` under its title unless its result file has one;
# tests/bench/test_benchmarks_named.py checks that every table has one and the script exists.
ORDER = [
    (
        "bench_dry_run.md",
        "Launcher",
        "bench/bench_dry_run.py",
        "python bench/bench_dry_run.py --repeats 11",
    ),
    (
        "bench_warm_start.md",
        "Launcher",
        "bench/bench_warm_start.py",
        "python bench/bench_warm_start.py --repeats 5",
    ),
    (
        "bench_rank_imports.md",
        "Launcher",
        "bench/bench_rank_imports.py",
        ".venv/bin/python bench/bench_rank_imports.py --pairs 10",
    ),
    (
        "bench_tp.md",
        "Training core",
        "bench/bench_tp.py",
        "python bench/bench_tp.py --hidden 256 --steps 5 --rounds 2 "
        "--out bench/results/bench_tp.md",
    ),
    (
        "tp_findings.md",
        "Training core",
        "bench/bench_tp.py",
        "python bench/bench_tp.py --profile --hidden 256 --steps 3",
    ),
    (
        "optimizations.md",
        "Training core",
        "bench/bench_optimizations.py",
        "python bench/bench_optimizations.py --rounds 3 --steps 3 --hidden 256",
    ),
    (
        "bench_train_loop.md",
        "Training core",
        "bench/bench_train_loop.py",
        ".venv/bin/python bench/bench_train_loop.py --steps 200 --grids x2z2 x2y2 data2z2 data4 "
        "--micro-batches 4 16",
    ),
    (
        "bench_checkpoint.md",
        "Training core",
        "bench/bench_checkpoint.py",
        ".venv/bin/python bench/bench_checkpoint.py --models wide vocab --seq 32",
    ),
    (
        "bench_packed.md",
        "Fine-tuning",
        "bench/bench_packed.py",
        ".venv/bin/python bench/bench_packed.py --rounds 7 --threads 2",
    ),
    ("bench_plan.md", "Planner", "bench/bench_plan.py", "python bench/bench_plan.py"),
    (
        "validate_planner.md",
        "Planner",
        "bench/validate_planner.py",
        "python bench/validate_planner.py steps=7 warmup=2",
    ),
    ("headline_plans.md", "Planner", "bench/headline_plans.py", "python bench/headline_plans.py"),
    ("validation_80b.md", "Planner", "bench/headline_plans.py", "python bench/headline_plans.py"),
    ("gpu.md", "GPU", "bench/gpu/run.sh", 'bench/gpu/fetch_wheels.sh && bench/gpu/run.sh "$OUT"'),
    ("bench_ztraffic.md", "Planner", "bench/bench_ztraffic.py", "python bench/bench_ztraffic.py"),
    (
        "bench_status.md",
        "Failures",
        "bench/bench_status.py",
        "python bench/bench_status.py --jobs 10000",
    ),
    (
        "bench_recovery.md",
        "Failures",
        "bench/bench_recovery.py",
        "python bench/bench_recovery.py --seed 7",
    ),
    ("bench_in_place.md", "Failures", "bench/bench_in_place.py", "python bench/bench_in_place.py"),
    ("bench_pack.md", "Sweeps", "bench/bench_pack.py", "python bench/bench_pack.py"),
    (
        "bench_watchdog.md",
        "Failures",
        "bench/bench_watchdog.py",
        ".venv/bin/python bench/bench_watchdog.py",
    ),
    (
        "bench_watchdog_fs.md",
        "Failures",
        "bench/bench_watchdog_fs.py",
        ".venv/bin/python bench/bench_watchdog_fs.py --ranks 64 --per-node 8 --beat 0.5"
        " --seconds 20 --hang-ranks 32",
    ),
    ("bench_sinks.md", "Curves", "bench/bench_sinks.py", ".venv/bin/python bench/bench_sinks.py"),
    (
        "bench_generation.md",
        "Generation",
        "bench/bench_generation.py",
        ".venv/bin/python bench/bench_generation.py --rounds 15 --threads 1",
    ),
    (
        "bench_hf_import.md",
        "Hugging Face import",
        "bench/bench_hf_import.py",
        ".venv/bin/python bench/bench_hf_import.py --rounds 2 --layers 4",
    ),
    (
        "memorization_study.md",
        "Memorization",
        "axonn_launch/conf/study/memorization.yaml",
        "python -m axonn_launch -m +study=memorization",
    ),
    (
        "bench_sweep_check.md",
        "Sweeps",
        "bench/bench_sweep_check.py",
        "python bench/bench_sweep_check.py --points 500 --pairs 10",
    ),
    (
        "rank_rehearsal.md",
        "Scale",
        "bench/scale/rank_points.py",
        "python bench/scale/rank_points.py; python bench/scale/rank_points.py"
        " --only gpt_320b_frontier_4096 --depth 100",
    ),
    (
        "bench_groups.md",
        "Scale",
        "bench/bench_groups.py",
        "python bench/bench_groups.py --pairs 10",
    ),
    (
        "dcp_plan.md",
        "Scale",
        "bench/scale/dcp_plan.py",
        "python bench/scale/dcp_plan.py",
    ),
    (
        "scale.md",
        "Scale",
        "bench/scale/run.py",
        "python bench/scale/run.py --nodes 8 32 128 256 512",
    ),
    (
        "scale_emulated.md",
        "Scale",
        "bench/scale/run.py",
        "python bench/scale/run.py --emulated --nodes 8 32 128 256 --budget-s 1200",
    ),
    (
        "scale_heal.md",
        "Scale",
        "bench/scale/heal.py",
        "python bench/scale/heal.py --nodes 8 32 128",
    ),
    (
        "scale_all.md",
        "Scale",
        "bench/scale/all.py",
        "python bench/scale/all.py --budget-s 7200",
    ),
    (
        "suite_notes.md",
        "Test suite",
        "bench/suite_times.py",
        "python bench/suite_times.py AFTER.xml --before BEFORE.xml",
    ),
    (
        "suite_table.md",
        "Test suite",
        "bench/suite_table.py",
        'python bench/suite_table.py DURATIONS.txt --source "..."',
    ),
    (
        "suite_times.md",
        "Test suite",
        "bench/suite_times.py",
        "python bench/suite_times.py AFTER.xml --before BEFORE.xml",
    ),
]
HEADER = """# Benchmarks

Measured on the project's development machine (2 CPU cores, 24 GiB, no GPU) unless a section
says otherwise. Timings are ratios or rankings measured side by side in one run; the machine is
shared and noisy, so absolute numbers move between runs. Regenerate a section with the command it
names, then this file with `python bench/make_benchmarks_md.py`.

Every section that has a table names the committed script and command that make it, on a line
`Script: <path> (`<command>`)` (tests/bench/test_benchmarks_named.py checks that the script
exists). An overhead figure (an option on against off) comes from at least 10 interleaved pairs
(`bench/pairs.py`): the median of on/off - 1 with its interquartile range and the load average
before and after; where the interquartile range holds zero it reads "below this machine's noise
(±X %)", not a point figure.

GPU runs (MFU on A100/MI250X/GH200/H200) have not been measured yet: no GPU machine was available
to the runs recorded here (the "GPU" section names the command that makes the first).
`metrics.jsonl` reports `mfu` against each machine profile's dense bf16 peak when a job runs on
GPUs.
"""


def demote(text: str) -> str:
    """Make each result's title a second-level heading under this file's title."""
    if not text.startswith("# "):
        return text
    lines = text.splitlines()
    fenced = False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            lines[i] = "#" + line
    return "\n".join(lines)


def named(text: str, script: str, command: str) -> str:
    """``text`` with a ``Script:`` line under its title, unless it names one already."""
    if any(line.startswith("Script: ") for line in text.splitlines()):
        return text
    title, _, rest = text.partition("\n")
    return f"{title}\n\nScript: {script} (`{command}`)\n{rest}"


def main() -> None:
    parts = [HEADER]
    for name, area, script, command in ORDER:
        path = HERE / "results" / name
        if path.exists():
            text = named(demote(path.read_text().strip()), script, command)
            parts.append(f"<!-- {area}: bench/results/{name} -->\n\n{text}\n")
    (HERE.parent / "BENCHMARKS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
