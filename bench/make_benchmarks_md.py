"""Assemble BENCHMARKS.md from the result files the benchmarks write in bench/results/.

    python bench/make_benchmarks_md.py

Each section is the verbatim output of one benchmark, with the command that produced it.
"""

from pathlib import Path

HERE = Path(__file__).parent
ORDER = [
    ("bench_dry_run.md", "Launcher"),
    ("bench_warm_start.md", "Launcher"),
    ("bench_tp.md", "Training core"),
    ("tp_findings.md", "Training core"),
    ("optimizations.md", "Training core"),
    ("bench_train_loop.md", "Training core"),
    ("bench_checkpoint.md", "Training core"),
    ("bench_packed.md", "Fine-tuning"),
    ("bench_plan.md", "Planner"),
    ("validate_planner.md", "Planner"),
    ("headline_plans.md", "Planner"),
    ("validation_80b.md", "Planner"),
    ("gpu.md", "GPU"),
    ("bench_ztraffic.md", "Planner"),
    ("bench_status.md", "Failures"),
    ("bench_recovery.md", "Failures"),
    ("bench_in_place.md", "Failures"),
    ("bench_pack.md", "Sweeps"),
    ("bench_watchdog.md", "Failures"),
    ("bench_sinks.md", "Curves"),
    ("bench_generation.md", "Generation"),
    ("bench_hf_import.md", "Hugging Face import"),
    ("memorization_study.md", "Memorization"),
    ("suite_notes.md", "Test suite"),
    ("suite_times.md", "Test suite"),
]
HEADER = """# Benchmarks

Measured on the project's development machine (2 CPU cores, 24 GiB, no GPU) unless a section
says otherwise. Timings are ratios or rankings measured side by side in one run; the machine is
shared and noisy, so absolute numbers move between runs. Regenerate a section with the command it
names, then this file with `python bench/make_benchmarks_md.py`.

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


def main() -> None:
    parts = [HEADER]
    for name, area in ORDER:
        path = HERE / "results" / name
        if path.exists():
            text = demote(path.read_text().strip())
            parts.append(f"<!-- {area}: bench/results/{name} -->\n\n{text}\n")
    (HERE.parent / "BENCHMARKS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
