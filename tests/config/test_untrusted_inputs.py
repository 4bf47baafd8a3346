"""Text and files the launcher must not trust. A ``%`` in the job dir reaches
Slurm's log options escaped; a ``latest`` pointer outside the dir is not followed by the
torch-free readers; every ``.idx`` entry and the safetensors headers of an HF directory
are checked on the login node, each fault refused in one line before anything is
written. (Control characters: rows of tests/config/test_bad_input.py; ``latest`` in the job:
tests/train/test_loop.py; NaN weights: tests/train/models/test_hf_import.py.)"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from axonn_launch.common import tokenfile
from axonn_launch.common.hf import hf_config_from_spec, hf_segments, weights_problem
from axonn_launch.common.indexed import index_bytes, index_file_problem
from axonn_launch.common.jobdir import JobPaths, checkpointed_step, latest_step_name
from axonn_launch.common.models import ModelSpec
from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import check_job_dir, resolve
from axonn_launch.submit import chain
from axonn_launch.submit.render import RELAY_SUFFIX, render_script
from tests.conftest import run_launcher

JOB_DIR = "/scratch/run%x 50%"  # a placeholder Slurm would expand, a bare '%', a space


@pytest.fixture(scope="module")
def slurm_local():
    cfg = load(["machine=slurm_local", "grid.x=2", "grid.z=2"])
    return cfg, resolve(cfg)


def test_percent_in_the_job_dir_reaches_slurm_escaped(slurm_local):
    """``--output``/``--error`` (``#SBATCH`` and srun) get ``%%``; submitit's ``%j``/``%t``
    stay placeholders; the folder submitit itself reads stays as it is."""
    cfg, resolved = slurm_local
    folder = Path(JOB_DIR) / "slurm" / "%j"
    script = render_script(machine=cfg.machine, nodes=resolved.nodes, folder=folder,
                           tasks_per_node=resolved.tasks_per_node, job_name=cfg.name,
                           python="/opt/venv/bin/python")  # fmt: skip
    escaped = "/scratch/run%%x 50%%/slurm/%j"
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, flags=re.M))
    assert flags["output"] == shlex.quote(f"{escaped}/%j_0_log.out")
    assert flags["error"] == shlex.quote(f"{escaped}/%j_0_log.err")
    (srun,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    words = shlex.split(srun.removesuffix(RELAY_SUFFIX))
    assert words[words.index("--output") + 1] == f"{escaped}/%j_%t_log.out"
    assert words[words.index("--error") + 1] == f"{escaped}/%j_%t_log.err"
    assert words[-1] == str(folder)  # python -m submitit.core._submit FOLDER: not Slurm's
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_recovery_jobs_log_path_is_escaped_too(slurm_local):
    cfg, _ = slurm_local
    script = chain.recovery_script(cfg, Path(JOB_DIR))
    (line,) = [ln for ln in script.splitlines() if ln.startswith("#SBATCH --output=")]
    assert line == "#SBATCH --output=" + shlex.quote("/scratch/run%%x 50%%/logs/recovery_%j.log")
    assert JobPaths(JOB_DIR).logs == Path(JOB_DIR) / "logs"


def test_job_dirs_submitit_or_slurm_would_misread_are_refused(slurm_local):
    slurm = slurm_local[0].machine
    check_job_dir(JOB_DIR, slurm)  # escaped instead
    for job_dir, words in [("/s/run%j", "holds %j, which submitit replaces"),
                           ("/s/%a%t", "holds %t, %a"),
                           ("/s/a\\b", "holds a backslash, which turns off Slurm's %j"),
                           ("/s/a\rb", "holds control characters ('\\r')")]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(f"hydra.run.dir={job_dir!r}: {words}")):
            check_job_dir(job_dir, slurm)
    local = load(["machine=local"]).machine
    check_job_dir("/s/run%j", local)  # no Slurm, no submitit folder: fine
    with pytest.raises(ConfigError, match="control characters"):
        check_job_dir("/s/a\0b", local)


# --- latest ---------------------------------------------------------------------------------


def test_a_latest_outside_the_dir_is_not_followed_by_the_readers(tmp_path):
    """The torch-free readers (status, resubmit, export) take what the job would resume
    from: the newest complete step here, never another dir's."""
    job, other = tmp_path / "job", tmp_path / "other"
    for folder, step in [(job, 2), (job, 4), (other, 9)]:
        JobPaths(folder).step(f"step_{step:08d}").mkdir(parents=True)
        (JobPaths(folder).step(f"step_{step:08d}") / "meta.json").write_text("{}")
    JobPaths(job).step("step_00000006").mkdir()  # newer, but incomplete: no meta.json
    pointer = JobPaths(job).latest
    outside = ["../../other/checkpoints/step_00000009", str(JobPaths(other).step("step_00000009"))]
    for text in [*outside, "step_9/../../x", "\x00garbage", ""]:
        pointer.write_text(text)
        assert latest_step_name(job) == "step_00000004", text
        assert checkpointed_step(job) == 4, text
    pointer.write_text("step_00000002\n")
    assert latest_step_name(job) == "step_00000002"  # a step of this dir: as named
    pointer.unlink()
    assert latest_step_name(job) is None and checkpointed_step(job) == 0


# --- Megatron .idx ----------------------------------------------------------------------------

SIZES = np.array([5, 7, 3, 9], dtype=np.int32)
DTYPE = np.dtype(np.uint16)


def write_indexed(folder: Path, idx: bytes) -> Path:
    """A .bin of sum(SIZES) uint16 tokens and the given .idx beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokens.bin"
    np.arange(int(SIZES.sum()), dtype=DTYPE).tofile(path)
    path.with_suffix(".idx").write_bytes(idx)
    return path


def corrupt(field: str, at: int, value: int) -> bytes:
    """The good .idx with one entry of ``sizes``, ``pointers`` or ``docs`` changed."""
    data = bytearray(index_bytes(SIZES, DTYPE))
    head, n = 9 + 25, len(SIZES)
    offset, fmt = {"sizes": (head + 4 * at, "<i4"), "pointers": (head + 4 * n + 8 * at, "<i8"),
                   "docs": (head + 12 * n + 8 * at, "<i8")}[field]  # fmt: skip
    data[offset : offset + np.dtype(fmt).itemsize] = np.array([value], fmt).tobytes()
    return bytes(data)


@pytest.mark.parametrize(
    "field, at, value, words",
    [
        ("pointers", 1, 10**12, "sequence 1 starts at byte 1,000,000,000,000, not a token"),
        ("sizes", 2, -4, "sequence 2 has size -4; sizes must be >= 0"),
        ("sizes", 1, 1000, "sequence 1 ends at byte 2,010, past the end of the .bin (48 bytes)"),
        ("sizes", 0, 6, "sequence 1 starts at byte 10, before sequence 0 ends (byte 12)"),
        ("pointers", 2, 4, "sequence 2 starts at byte 4, before sequence 1 ends (byte 24)"),
        ("pointers", 1, 11, "sequence 1 starts at byte 11, not a token boundary"),
        ("docs", 2, 0, "document 2 starts at sequence 0, before document 1"),
        ("docs", 1, 9, "document 1 starts at sequence 9, outside 0..4"),
    ],
)
def test_every_idx_entry_is_checked(tmp_path, field, at, value, words):
    """The header check alone (tokenfile: the last entry's end is the .bin's length) lets
    a bad entry in the middle through; index_file_problem reads them all."""
    good = write_indexed(tmp_path / "good", index_bytes(SIZES, DTYPE))
    assert index_file_problem("train.data", str(good)) is None
    bad = write_indexed(tmp_path / "bad", corrupt(field, at, value))
    if at < len(SIZES) - 1:
        assert tokenfile.problem("train.data", str(bad), 256) is None  # what was checked
    problem = index_file_problem("train.data", str(bad))
    assert problem and problem.startswith(f"train.data={str(bad)!r}: tokens.idx: "), problem
    assert words in problem and "\n" not in problem, problem


def test_a_corrupt_idx_is_refused_by_the_launcher_in_one_line(tmp_path):
    data = write_indexed(tmp_path / "data", corrupt("pointers", 1, 10**12))
    work = tmp_path / "cwd"
    work.mkdir()
    result = run_launcher([f"train.data={data}", "dry_run=true"], cwd=work)
    assert result.returncode == 2, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith(f"error: train.data={str(data)!r}: tokens.idx: sequence 1 starts")
    assert list(work.iterdir()) == []


# --- Hugging Face weights, from the safetensors headers -------------------------------------

SPEC = ModelSpec("tiny", arch="llama", n_layer=1, d_model=64, n_head=4, n_kv_head=2,
                 ffn_hidden=128, vocab_size=256, max_seq_len=64, tie_embeddings=False)  # fmt: skip


def hf_dir(folder: Path, *, int64: str = "") -> Path:
    """A 1-layer Llama of zeros in two shards and their index, written with numpy (no
    torch, no transformers); the tensor named ``int64`` stored as int64."""
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config_from_spec(SPEC)))
    shapes = {}
    for ours, pieces in hf_segments(SPEC).items():
        columns = () if ours.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else (64,)
        columns = (128,) if ours.endswith("mlp.down.weight") else columns
        shapes.update({name: (rows, *columns) for name, rows in pieces})
    names = sorted(shapes)
    shards = {f"model-0000{n + 1}-of-00002.safetensors": names[n::2] for n in range(2)}
    weight_map = {}
    for file, members in shards.items():
        tensors = {m: np.zeros(shapes[m], np.int64 if m == int64 else np.float32) for m in members}
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(members, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_hf_weights_are_checked_from_their_headers(tmp_path):
    good = hf_dir(tmp_path / "good")
    assert weights_problem(str(good), hf_segments(SPEC)) is None
    tied = hf_segments(replace(SPEC, tie_embeddings=True))
    assert weights_problem(str(good), tied) is None  # lm_head.weight left unread
    wrong = hf_dir(tmp_path / "int", int64="model.layers.0.mlp.up_proj.weight")
    assert weights_problem(str(wrong), hf_segments(SPEC)).endswith(
        "tensor 'model.layers.0.mlp.up_proj.weight' in model-00002-of-00002.safetensors is"
        " stored as I64; valid: a floating-point dtype (F16, BF16, F32, F64)"
    )
    cut = hf_dir(tmp_path / "cut")
    shard = cut / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "model-00001-of-00002.safetensors: truncated (" in weights_problem(
        str(cut), hf_segments(SPEC)
    )


@pytest.mark.parametrize("fault", ["missing shard", "int64 weight"])
def test_a_broken_hf_directory_is_refused_by_the_launcher_in_one_line(tmp_path, fault):
    tensor = "model.layers.0.self_attn.k_proj.weight"
    folder = hf_dir(tmp_path / "hf", int64=tensor if fault == "int64 weight" else "")
    if fault == "missing shard":
        (folder / "model-00002-of-00002.safetensors").unlink()
        words = "model.safetensors.index.json names 'model-00002-of-00002.safetensors', which"
    else:
        words = f"tensor {tensor!r} in model-00002-of-00002.safetensors is stored as I64"
    work = tmp_path / "cwd"
    work.mkdir()
    args = ["model=hf", f"model.init_from={folder}", "train.data=synthetic", "dry_run=true"]
    result = run_launcher(args, cwd=work)
    assert result.returncode == 2, result.stderr + result.stdout
    (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith(f"error: model.init_from={str(folder)!r}: {words}"), line
    assert list(work.iterdir()) == []
