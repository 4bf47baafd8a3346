"""Report and status on the first day: one tokens/s for the report, the console
and ``jobs status``; plot titles name the job; a sweep over how jobs run plots tokens/s by
default with a tick at each whole-number value; the ``jobs status`` table fits 120 columns.

The job and sweep directories are written here as a finished local run leaves them
(job.json, spec.json, metrics.jsonl, summary.json, points/), so no test trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch import report

TIME_DIR = "2026-12-02_19-18-43-204758"  # the launcher's job dir name under jobs/<name>/
TOKENS_PER_STEP = 2048  # global batch 16 x seq_len 128


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def make_job(
    job_dir: Path,
    name: str,
    step_times: list[float],
    *,
    finished: bool = True,
    grid: dict | None = None,
    summary: dict | None = None,
    status: str = "completed",
    log: str = "",
) -> Path:
    """A local job of ``len(step_times)`` steps as its launcher and rank 0 leave it; its
    summary.json (when ``finished``) counts tokens/s as the job does: the steps after the
    first, total tokens over total seconds."""
    job_dir.mkdir(parents=True)
    steps = len(step_times)
    record = {
        "name": name, "model": "llama_tiny", "machine": "local", "job_ids": ["local-54613"],
        "grid": grid or {"data": 1, "x": 2, "y": 1, "z": 2}, "nodes": 1, "tasks_per_node": 4,
        "steps": steps, "status": status, "exit_code": 0 if status == "completed" else 1,
    }  # fmt: skip
    (job_dir / "job.json").write_text(json.dumps(record))
    train = {"global_batch": 16, "seq_len": 128}
    (job_dir / "spec.json").write_text(json.dumps({"train": train}))
    rows = [
        {"step": i + 1, "loss": 5.0 - i / 10, "lr": 1e-3, "step_time_s": t,
         "tokens_per_s": TOKENS_PER_STEP / t, "mfu": None}
        for i, t in enumerate(step_times)
    ]  # fmt: skip
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        after_first = step_times[1:]
        done = {
            "steps": steps, "final_loss": rows[-1]["loss"],
            "tokens_per_s": TOKENS_PER_STEP * len(after_first) / sum(after_first),
            "step_time_s": sum(after_first) / len(after_first), "tflops_per_gpu": 0.001,
            "mfu": None,
        }  # fmt: skip
        (job_dir / "summary.json").write_text(json.dumps(done | (summary or {})))
    if log:
        (job_dir / "logs").mkdir()
        (job_dir / "logs" / "rank_0.log").write_text(log)
    return job_dir


def report_speed(job_dir: Path, cwd: Path) -> str:
    made = run("axonn_launch.report", str(job_dir), cwd=cwd)
    assert made.returncode == 0, made.stderr
    markdown = (job_dir / "report" / "report.md").read_text()
    (line,) = [row for row in markdown.splitlines() if row.startswith("| tokens/s")]
    return line.split("|")[2].strip()


def status_speed(job_dir: Path, cwd: Path) -> str:
    shown = run("axonn_launch.jobs", "status", str(job_dir), cwd=cwd)
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()[:2]
    return row.split()[header.replace("JOB ID", "JOB_ID").split().index("TOK/S")]


# ------------------------------------------------------------------------------ job


def test_report_and_status_show_the_same_tokens_per_s(tmp_path):
    # after step 1 the rates are 20480, 10240, 20480, 10240 tokens/s: their mean (the old
    # report's figure, 15360) is not the job's tokens over its seconds (13653, the console's)
    job = make_job(tmp_path / "jobs" / "a" / TIME_DIR, "a", [0.5, 0.1, 0.2, 0.1, 0.2])
    summary = json.loads((job / "summary.json").read_text())
    mean_of_rates = sum(TOKENS_PER_STEP / t for t in (0.1, 0.2, 0.1, 0.2)) / 4
    assert f"{mean_of_rates:.0f}" != f"{summary['tokens_per_s']:.0f}"  # 15360 vs 13653
    assert report_speed(job, tmp_path) == f"{summary['tokens_per_s']:.0f}"
    assert status_speed(job, tmp_path) == f"{summary['tokens_per_s']:.0f}"


def test_a_job_without_summary_shows_its_last_step_in_both(tmp_path):
    job = make_job(tmp_path / "jobs" / "b" / TIME_DIR, "b", [0.5, 0.1, 0.4], finished=False,
                   status="running")  # fmt: skip
    assert report_speed(job, tmp_path) == status_speed(job, tmp_path) == "5120"  # 2048 / 0.4


def test_job_plot_titles_name_the_job_not_its_time_dir(tmp_path, monkeypatch):
    job = make_job(tmp_path / "jobs" / "llama_tiny-local" / TIME_DIR, "llama_tiny-local",
                   [0.5, 0.1, 0.2])  # fmt: skip
    titles = []
    drawn = report.plot

    def plot(*args, **keywords) -> Path:
        titles.append(keywords["title"])
        return drawn(*args, **keywords)

    monkeypatch.setattr(report, "plot", plot)
    assert report.main([str(job)]) == 0
    assert len(titles) == 4  # loss by step and by tokens, learning rate, tokens/s
    assert all(t.endswith(": llama_tiny-local") and TIME_DIR not in t for t in titles), titles


# ---------------------------------------------------------------------------- sweeps


def make_sweep(root: Path, points: list[tuple[str, dict]], *, val_loss: bool = False) -> Path:
    """A sweep dir whose points ran; ``points``: (overrides, summary values) each."""
    sweep = root / "jobs" / "sweeps" / TIME_DIR
    (sweep / "points").mkdir(parents=True)
    for num, (overrides, values) in enumerate(points):
        job = make_job(sweep / f"{num}-p", f"p{num}", [0.5, 0.1, 0.1], summary=values)
        if val_loss:
            with (job / "metrics.jsonl").open("a") as rows:
                rows.write(json.dumps({"step": 3, "loss": 4.8, "val_loss": 4.0 + num}) + "\n")
        record = {"num": num, "point": overrides, "status": "completed", "job_dir": job.name}
        (sweep / "points" / f"{num}.json").write_text(json.dumps(record))
    return sweep


def plotted(sweep: Path, monkeypatch, *args: str) -> tuple[str, dict[str, dict]]:
    """(report.md, the plot() keywords of each sweep image by file name)."""
    calls = {}
    drawn = report.plot

    def plot(path: Path, *args, **keywords) -> Path:
        calls[path.name] = keywords
        return drawn(path, *args, **keywords)

    monkeypatch.setattr(report, "plot", plot)
    assert report.main([str(sweep), *args]) == 0
    return (sweep / "report" / "report.md").read_text(), calls


GRID_SWEEP = [
    (f"grid.x={x} grid.z={z}", {"final_loss": 4.5, "tokens_per_s": 1000.0 * x + 100 * z})
    for x in (1, 2)
    for z in (1, 2)
]


def test_a_grid_sweep_plots_tokens_per_s_with_whole_ticks(tmp_path, monkeypatch):
    sweep = make_sweep(tmp_path, GRID_SWEEP)
    markdown, calls = plotted(sweep, monkeypatch)
    assert sorted(calls) == ["sweep_tokens_per_s_grid.x.png", "sweep_tokens_per_s_grid.z.png"]
    assert "metric: tokens_per_s (every swept key changes how the jobs run" in markdown
    for keywords in calls.values():
        assert keywords["ylabel"] == "tokens/s"
        assert keywords["xticks"] == [(1.0, "1"), (2.0, "2")]  # no 1.2, 1.4 ...
    # --metric still picks
    markdown, calls = plotted(sweep, monkeypatch, "--metric", "final_loss")
    assert sorted(calls) == ["sweep_final_loss_grid.x.png", "sweep_final_loss_grid.z.png"]


def test_a_sweep_of_what_is_computed_plots_the_loss(tmp_path, monkeypatch):
    points = [(f"train.lr={lr} grid.x=2", {"final_loss": loss, "tokens_per_s": 9000.0})
              for lr, loss in (("0.001", 4.8), ("0.003", 4.2))]  # fmt: skip
    markdown, calls = plotted(make_sweep(tmp_path / "a", points), monkeypatch)
    assert list(calls) == ["sweep_final_loss_train.lr.png"]  # grid.x is not swept
    lr_plot = calls["sweep_final_loss_train.lr.png"]
    assert lr_plot["logx"] and lr_plot["xlabel"] == "train.lr (log scale)"
    assert lr_plot["xticks"] == [(0.001, "0.001"), (0.002, "0.002")]
    markdown, calls = plotted(make_sweep(tmp_path / "b", points, val_loss=True), monkeypatch)
    assert list(calls) == ["sweep_val_loss_train.lr.png"]
    assert "metric: val_loss (a swept key changes what the jobs compute" in markdown


def test_the_sweep_report_command_names_its_metric(tmp_path):
    sweep = make_sweep(tmp_path, GRID_SWEEP)
    made = run("axonn_launch.report", str(sweep), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (sweep / "report" / "sweep_tokens_per_s_grid.x.png").is_file()


@pytest.mark.parametrize(
    "values, ticks",
    [
        (["1", "2", "4"], [(1.0, "1"), (2.0, "2"), (4.0, "4")]),
        (["0.001", "0.003"], None),
        ([str(n) for n in range(1, 20)], None),  # many: matplotlib's own ticks
        (["gloo", "nccl"], [(0.0, "gloo"), (1.0, "nccl")]),
    ],
)
def test_sweep_ticks(values, ticks):
    numeric = all(report.as_number(v) is not None for v in values)
    assert report.sweep_ticks(values, numeric) == ticks


def test_an_optuna_lr_sweep_reads_on_a_log_axis_without_offsets():
    """Trials spread in log(lr); losses that differ in the 6th digit."""
    lrs = [0.00031, 0.00052, 0.0011, 0.0024, 0.0047, 0.0098]
    losses = [5.512310 + 1e-6 * i for i in range(len(lrs))]
    assert report.log_axis("train.lr", lrs) and report.log_axis("grid.x", [1, 64])
    assert not report.log_axis("train.warmup_steps", [10, 50])
    ticks = report.sweep_ticks([str(lr) for lr in lrs], True, log=True)
    assert ticks == [(5e-4, "0.0005"), (1e-3, "0.001"), (2e-3, "0.002"), (5e-3, "0.005")]
    plt = report.pyplot()
    fig, ax = report.draw(plt, [("loss", lrs, losses)], xlabel="train.lr", ylabel="loss",
                          title="t", logx=True, xticks=ticks)  # fmt: skip
    fig.canvas.draw()
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.0005", "0.001", "0.002", "0.005"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] == []
    assert ax.yaxis.get_major_formatter().get_offset() == ""  # no "+5.51231e0" corner
    assert all(t.get_text().startswith("5.5123") for t in ax.get_yticklabels())
    assert all(t.get_rotation() == 0 for t in ax.get_xticklabels())
    plt.close(fig)


def test_long_tick_labels_are_slanted_not_run_together():
    names = [f"train.overlap.mode_{i}" for i in range(5)]
    plt = report.pyplot()
    fig, ax = report.draw(plt, [("m", [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])], xlabel="k",
                          ylabel="m", title="t", xticks=list(enumerate(names)))  # fmt: skip
    assert all(t.get_rotation() == 30 for t in ax.get_xticklabels())
    plt.close(fig)


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (1e-4, 1e-2, ["0.0001", "0.0002", "0.0005", "0.001", "0.002", "0.005", "0.01"]),
        (1e-6, 1e-1, ["1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"]),  # thinned
        (3e-4, 4.5e-4, ["0.0003", "0.0004"]),  # within a decade: more steps
    ],
)
def test_log_ticks(low, high, expected):
    assert [label for _, label in report.log_ticks(low, high)] == expected


# ---------------------------------------------------------------------------- status


def test_the_status_table_fits_120_columns(tmp_path):
    jobs = tmp_path / "jobs"
    make_job(jobs / "llama_tiny-local" / TIME_DIR, "llama_tiny-local", [0.5, 0.1])
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    make_job(jobs / "gpt_tiny-local" / TIME_DIR, "gpt_tiny-local", [0.5, 0.1], finished=False,
             status="failed", log=oom)  # fmt: skip
    sweep = jobs / "sweeps" / "2026-12-02_19-21-39"  # a sweep's dir, then its points'
    make_job(sweep / "3-gpt_tiny-local-x2-z2", "gpt_tiny-local-x2-z2", [0.5, 0.1, 0.1],
             grid={"data": 2, "x": 2, "y": 2, "z": 2})  # fmt: skip
    shown = run("axonn_launch.jobs", "status", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = ["JOB", "ID", "GRID", "STATE", "STEP", "LOSS", "TOK/S", "CLASS", "DIR"]
    assert lines[0].split() == header
    table = [line for line in lines if not line.startswith("  ")]
    assert len(table) == 4 and max(len(line) for line in table) <= 120, shown.stdout
    assert any("gpu_oom" in line for line in table)
    assert any("d2x2y2z2" in line and "3-gpt_tiny-local-x2-z2" in line for line in table)
    (note,) = [line for line in lines if line.startswith("  ")]
    assert "CUDA out of memory" in note and note.endswith("(action: retry_only_with_new_grid)")
