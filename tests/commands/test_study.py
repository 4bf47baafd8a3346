"""The memorization study (axonn_launch.study, conf/study/memorization.yaml) in miniature:
its data as the loader reads it, and a real two-point sweep that trains, measures
memorization in the job, and reports."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from axonn_launch.common.memorization_metric import read_documents
from axonn_launch.submit import study_data as study
from axonn_launch.train.data import open_source
from tests.conftest import run_launcher


def count(haystack: bytes, needle: bytes) -> int:
    return haystack.count(needle)


def test_prepare_puts_each_canary_r_times_in_the_train_split_only(tmp_path):
    info = study.prepare(
        tmp_path, canaries=5, canary_len=40, repetitions=[0, 3], seed=7, corpus_bytes=8000
    )
    canaries = [bytes(d) for d in read_documents(tmp_path / "canaries.jsonl", None)]
    assert len(canaries) == 5 and all(len(c) == 40 for c in canaries)
    assert len(set(canaries)) == 5
    val = bytes(open_source(str(tmp_path / "val.bin"), model_vocab=256, split="all").tokens)
    _, corpus_val = study.corpus_splits()
    assert val == corpus_val  # the same validation text for every R, no canary in it
    for r in (0, 3):
        path = str(tmp_path / f"r{r}.bin")
        train = bytes(open_source(path, model_vocab=256, split="train").tokens)
        held = bytes(open_source(path, model_vocab=256, split="val").tokens)
        assert len(train) == info["files"][f"r{r}"]["train_tokens"]
        assert [count(train, c) for c in canaries] == [r] * 5
        assert all(count(held, c) == 0 for c in canaries)  # the tail is never trained on
        corpus = train
        for c in canaries:
            corpus = corpus.replace(c, b"")
        assert corpus == study.corpus_splits(8000)[0]  # the corpus, in order, untouched
        assert json.loads((tmp_path / f"r{r}.bin.json").read_text())["vocab_size"] == 256
    assert study.prepared(
        tmp_path, canaries=5, canary_len=40, repetitions=[0, 3], seed=7, corpus_bytes=8000
    )
    assert not study.prepared(tmp_path, canaries=6, canary_len=40, repetitions=[0, 3])


def test_canaries_are_random_lowercase_words_and_seeded():
    a, b = study.make_canaries(3, 64, seed=1), study.make_canaries(3, 64, seed=1)
    assert a == b != study.make_canaries(3, 64, seed=2)
    letters = np.frombuffer(b"".join(a), dtype=np.uint8)
    assert set(letters.tolist()) <= set(range(ord("a"), ord("z") + 1)) | {ord(" ")}


@pytest.mark.parametrize("trained", [1, 8, 9, 10, 12345, 363835])
def test_tail_puts_the_loader_cut_after_the_training_text(trained):
    tail = study.tail_length(trained)
    assert int((trained + tail) * 0.9) == trained


def test_bad_settings_are_one_line_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "axonn_launch.study", "prepare", "--out", str(tmp_path),
         "--canaries", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --canaries=0: expected an integer >= 1"


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("study.canaries=0", "error: study.canaries=0: expected an integer >= 1"),
        (
            "study.all_repetitions=[1,-1]",
            "error: study.all_repetitions=[1, -1]: expected counts >= 0",
        ),
        ("study.seed=x", "error: study.seed='x': expected an integer >= 0"),
        ("train.steps=0", "error: train.steps=0: must be a positive integer"),
    ],
)
def test_a_study_run_with_bad_settings_writes_nothing(tmp_path, override, error):
    """The pre-flight prepares a single run's study data, but only once all is valid."""
    result = run_launcher(["+study=memorization", f"study.dir={tmp_path / 'data'}", override],
                          cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == error
    assert sorted(p.name for p in tmp_path.iterdir()) == []


TINY_STUDY = [
    "study.canaries=4",
    "study.canary_len=48",
    "study.corpus_bytes=4000",
    "study.all_repetitions=[4]",
    "study.repetitions=4",
    "model=study_s",
    "train.steps=4",
    "train.eval_batches=1",
    "memorization.continuation=16",
]


def test_one_point_of_a_study_runs_without_a_sweep_on_fresh_data(tmp_path):
    """No -m: the pre-flight, which checks that train.data exists, prepares it first."""
    data = tmp_path / "data"
    args = ["+study=memorization", f"study.dir={data}", *TINY_STUDY, "train.goldfish.k=4"]
    result = run_launcher(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((data / "study.json").read_text())["files"]["r4"]["repetitions"] == 4
    (summary,) = (tmp_path / "jobs").glob("*/*/summary.json")
    assert json.loads(summary.read_text())["steps"] == 4
    assert (summary.parent / "memorization.json").is_file()


def test_a_two_point_study_trains_measures_and_reports(tmp_path):
    """+study=memorization with tiny settings: each point has memorization.json and a
    validation loss in its summary, and the report draws the memorization plot."""
    data, sweep = tmp_path / "data", tmp_path / "sweep"
    args = [
        "-m",
        "+study=memorization",
        f"study.dir={data}",
        *TINY_STUDY,
        "train.goldfish.k=0,4",
        f"hydra.sweep.dir={sweep}",
    ]
    result = run_launcher(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (data / "study.json").is_file()
    points = sorted(p for p in sweep.iterdir() if (p / "job.json").is_file())
    assert len(points) == 2
    for point in points:
        memo = json.loads((point / "memorization.json").read_text())
        summary = json.loads((point / "summary.json").read_text())
        assert memo["n_documents"] == 4 and memo["continuation"] == 16
        assert memo["repetitions"] == 4 and memo["rouge_on"] == "words"
        assert all(len(row["output_ids"]) == 16 for row in memo["documents"])
        assert summary["exact_match_rate"] == memo["exact_match_rate"]
        assert 0.0 <= summary["token_match"] <= 1.0
        assert np.isfinite(summary["val_loss"])
    ks = sorted(json.loads((p / "spec.json").read_text())["train"]["goldfish"]["k"] for p in points)
    assert ks == [0, 4]
    out = tmp_path / "report"
    report = subprocess.run(
        [sys.executable, "-m", "axonn_launch.report", str(sweep), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert (out / "memorization.png").stat().st_size > 0
    text = (out / "report.md").read_text()
    assert "## Memorization" in text and "goldfish k=4" in text and "standard" in text


def test_scale_full_switches_the_study_to_tinyllama_on_a_cluster():
    """`+study=memorization scale=full`: TinyLlama-1B shapes, 2048-token sequences,
    50-token continuations, Slurm's cores per task; the CPU scale is the default."""
    from axonn_launch.config.compose import load

    cpu = load(["+study=memorization"])
    assert (cpu.train.steps, cpu.train.seq_len, cpu.train.threads) == (2000, 64, 1)
    assert cpu.memorization.continuation == 32
    full = load(["+study=memorization", "scale=full", "machine=frontier", "nodes=16"])
    assert full.model.name == "tinyllama_1b" and full.model.n_layer == 22
    assert (full.train.seq_len, full.train.global_batch, full.train.threads) == (2048, 256, 0)
    assert full.memorization.continuation == 50
    assert full.train.goldfish.h == cpu.train.goldfish.h == 32
