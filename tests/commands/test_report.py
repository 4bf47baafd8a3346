"""``python -m axonn_launch.report``: on a real job directory from a short local run, on
sweep directories built from copies of it (one with a memorization study), and against a
real planner JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch import report
from tests.conftest import REPO

PNG = b"\x89PNG\r\n\x1a\n"


def run(*argv: str, cwd: Path, env: dict | None = None, timeout: int = 120):
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def real_job(tmp_path_factory) -> Path:
    """gpt_tiny on the built-in corpus, 6 steps, 4 local processes (x=2, z=2)."""
    job = tmp_path_factory.mktemp("run") / "job"
    proc = run(
        "axonn_launch",
        "train.steps=6",
        "train.sample_tokens=0",
        f"hydra.run.dir={job}",
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return job


def images_of(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def assert_pngs(out: Path, names: list[str]) -> None:
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name


def copy_job(
    job: Path,
    to: Path,
    *,
    summary: dict | None = None,
    spec_train: dict | None = None,
    memorization: dict | None = None,
) -> Path:
    shutil.copytree(job, to, ignore=shutil.ignore_patterns("checkpoints", "logs", "report"))
    if summary:
        path = to / "summary.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | summary))
    if spec_train:
        spec = json.loads((to / "spec.json").read_text())
        spec["train"] = spec["train"] | spec_train
        (to / "spec.json").write_text(json.dumps(spec))
    if memorization is not None:
        (to / "memorization.json").write_text(json.dumps(memorization))
    return to


def point(sweep: Path, num: int, overrides: str, job_dir: Path | None, status="completed"):
    (sweep / "points").mkdir(parents=True, exist_ok=True)
    record = {
        "num": num,
        "point": overrides,
        "status": status,
        "job_dir": str(job_dir or ""),
        "job_id": "",
        "nodes": 1,
        "message": "",
        "objective": "final_loss",
        "value": None,
    }
    (sweep / "points" / f"{num}.json").write_text(json.dumps(record))


# -------------------------------------------------------------------------------- job


def test_job_report_from_a_real_run(real_job, tmp_path):
    out = tmp_path / "out"
    proc = run("axonn_launch.report", str(real_job), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    markdown = (out / "report.md").read_text()
    names = images_of(markdown)
    assert names == ["loss.png", "loss_tokens.png", "lr.png", "tokens_per_s.png"]
    assert_pngs(out, names)
    summary = json.loads((real_job / "summary.json").read_text())
    assert f"| final loss | {summary['final_loss']:.4g} |" in markdown
    assert "| tokens | 6,144 |" in markdown  # 6 steps x global batch 16 x seq_len 64
    assert "| grid (data, x, y, z) | 1, 2, 1, 2 |" in markdown
    assert "No MFU" in markdown  # CPU: mfu is null on every row


def test_validation_loss_and_default_out(real_job, tmp_path):
    job = copy_job(real_job, tmp_path / "job")
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["step"] % 3 == 0:
            row["val_loss"] = 6.0 - row["step"] / 10
    (job / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 7, "lo')
    assert report.main([str(job)]) == 0
    markdown = (job / "report" / "report.md").read_text()
    assert "| final validation loss | 5.4 |" in markdown  # step 6
    assert "| steps | 6 |" in markdown  # the torn last line is left out
    assert_pngs(job / "report", images_of(markdown))


# ------------------------------------------------------------------------------ sweep


def test_sweep_report_metric_against_swept_keys(real_job, tmp_path):
    sweep = tmp_path / "sweep"
    losses = {(1, "0.001"): 5.0, (1, "0.003"): 4.5, (2, "0.001"): 4.9, (2, "0.003"): 4.4}
    for num, ((x, lr), loss) in enumerate(losses.items()):
        job = copy_job(
            real_job,
            sweep / str(num) / "job",
            summary={"final_loss": loss, "tokens_per_s": 1000.0 * x},
        )
        point(sweep, num, f"grid.x={x} train.lr={lr} train.steps=6", job)
    point(sweep, 4, "grid.x=4 train.lr=0.001 train.steps=6", None, status="invalid")
    out = tmp_path / "out"
    assert report.main([str(sweep), "--out", str(out), "--metric", "final_loss"]) == 0
    markdown = (out / "report.md").read_text()
    assert images_of(markdown) == ["sweep_final_loss_grid.x.png", "sweep_final_loss_train.lr.png"]
    assert_pngs(out, images_of(markdown))
    assert "| 1 | 1 | 0.003 | completed | 4.5 |" in markdown
    assert "| 4 | 4 | 0.001 | invalid | - |" in markdown
    assert "train.steps" not in markdown  # not swept
    assert report.main([str(sweep), "--out", str(out), "--metric", "tokens_per_s"]) == 0
    assert "| 3 | 2 | 0.003 | completed | 2000 |" in (out / "report.md").read_text()
    assert report.fmt(61860.0, report.METRIC_FORMS["tokens_per_s"]) == "61860"  # not 6.186e+04


def test_memorization_study(real_job, tmp_path):
    """Exact match against repetitions, one line per (loss, model)."""
    sweep = tmp_path / "study"
    rates = {(0, 1): 0.1, (0, 4): 0.5, (0, 16): 0.9, (4, 1): 0.0, (4, 4): 0.02, (4, 16): 0.05}
    for num, ((k, r), rate) in enumerate(rates.items()):
        job = copy_job(
            real_job,
            sweep / str(num),
            spec_train={"goldfish": {"k": k, "h": 4, "strategy": "hash-table"}},
            memorization={"exact_match_rate": rate, "rouge_l": rate, "n_documents": 8},
            summary={"val_loss": 2.0 + k / 40 + r / 100},
        )
        point(sweep, num, f"train.goldfish.k={k} +train.repetitions={r}", job)
    points = report.read_sweep(sweep)
    rows = report.memorization_rows(points)
    assert [(r["loss"], r["repetitions"], r["exact_match_rate"]) for r in rows] == [
        ("standard", 1, 0.1),
        ("standard", 4, 0.5),
        ("standard", 16, 0.9),
        ("goldfish k=4 hash-table h=4", 1, 0.0),
        ("goldfish k=4 hash-table h=4", 4, 0.02),
        ("goldfish k=4 hash-table h=4", 16, 0.05),
    ]
    # each Goldfish point against the standard point of the same model and R
    gaps = [r["val_vs_standard"] for r in rows]
    assert gaps[:3] == [None] * 3
    assert gaps[3:] == pytest.approx([0.1 / 2.01, 0.1 / 2.04, 0.1 / 2.16])
    assert {r["model"] for r in rows} == {"gpt_tiny (0.121M)"}
    out = tmp_path / "out"
    assert report.main([str(sweep), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "memorization.png" in images_of(markdown)
    row = (
        "| 4 | goldfish k=4 hash-table h=4 | gpt_tiny (0.121M) | 4 | 0.020 | - | 0.020 | 2.140 "
        "| +4.9% |"
    )
    assert row in markdown
    assert_pngs(out, images_of(markdown))


# ------------------------------------------------------------------------------- plan


def test_plan_against_measured(real_job, tmp_path):
    proc = run(
        "axonn_launch.plan",
        "machine=local",
        "model=gpt_tiny",
        "nodes=1",
        "top=20",
        "output=json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(proc.stdout)
    predicted = next(
        p["step_time_s"]
        for p in json.loads(proc.stdout)["plans"]
        if p["grid"] == {"data": 1, "x": 2, "y": 1, "z": 2}
    )
    measured = json.loads((real_job / "summary.json").read_text())["step_time_s"]
    out = tmp_path / "out"
    assert report.main([str(real_job), "--out", str(out), "--plan", str(plan_file)]) == 0
    markdown = (out / "report.md").read_text()
    assert f"| {predicted:.3g} | {measured:.3g} | {measured / predicted:.2f} |" in markdown
    assert "plan.png" in images_of(markdown)
    assert_pngs(out, images_of(markdown))


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}"], "neither a job directory (job.json) nor a sweep directory (points/)"),
        (["{job}", "--metric", "loss"], "--metric=loss: valid: final_loss, val_loss, tokens_per_s"),
        (["{job}", "--plan", "{tmp}/none.json"], "not a planner JSON"),
        (["{job}", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_exit_2(real_job, tmp_path, args, message):
    argv = [a.format(tmp=tmp_path, job=real_job) for a in args]
    argv += ["--out", str(tmp_path / "out")] if args[0] == "{job}" else []
    proc = run("axonn_launch.report", *argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr


def test_missing_matplotlib_is_one_line(real_job, tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    env = {"PYTHONPATH": f"{blocker}:{REPO}", "PATH": "/usr/bin:/bin"}
    proc = run(
        "axonn_launch.report", str(real_job), "--out", str(tmp_path / "o"), cwd=tmp_path, env=env
    )
    assert proc.returncode == 2
    assert proc.stderr == "error: matplotlib is missing: pip install -e '.[plot]'\n"
    assert not (tmp_path / "o").exists()
