"""Bad token files are refused on the login node: one line naming
train.data, exit code 2, no job dir, before any rank starts; ``data prepare`` records the
largest token id, which the launcher checks against the model's vocabulary."""

from __future__ import annotations

import array
import json
from pathlib import Path

import numpy as np
import pytest

from axonn_launch.common import tokenfile
from axonn_launch.common.indexed import IndexedWriter, token_dtype
from axonn_launch.data import main
from axonn_launch.train.data import SHAKESPEARE, bin_dtype
from tests.conftest import run_launcher


def write_ids(path: Path, ids: list[int], code: str = "H") -> Path:
    path.write_bytes(array.array(code, ids).tobytes())
    return path


def refused(tmp_path: Path, data: Path | str, *extra: str) -> str:
    """Launch gpt_tiny on ``data`` from an empty directory; the one error line, after
    checking that the launcher exits 2 and writes nothing."""
    work = tmp_path / "cwd"
    work.mkdir()
    job = tmp_path / "job"
    proc = run_launcher([f"train.data={data}", f"hydra.run.dir={job}", *extra], cwd=work)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: train.data='{data}': "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not job.exists() and list(work.iterdir()) == []
    return lines[0]


BAD_FILES = {  # name -> (write it into a directory, what the error line says)
    "empty": (lambda d: write_ids(d / "empty.bin", []), "an empty file; valid: a .bin of uint16"),
    "odd-sized": (
        lambda d: (d / "odd.bin").write_bytes(bytes(1001)),
        "1,001 bytes is not a whole number of uint16 tokens (2 bytes each",
    ),
    "out of vocabulary": (  # gpt_tiny has 256 ids
        lambda d: write_ids(d / "wide.bin", [i % 256 for i in range(6229)] + [300] * 10),
        "token id 300 at token 6,229 is outside [0, 256) (model.vocab_size=256; read as uint16",
    ),
    "a directory": (lambda d: (d / "dir.bin").mkdir(), "a directory; valid: shakespeare,"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_token_file_is_refused_in_one_line(tmp_path, case):
    write, says = BAD_FILES[case]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write(data_dir)
    (path,) = data_dir.iterdir()
    assert says in refused(tmp_path, path)


def test_a_dry_run_refuses_a_bad_file_that_is_here(tmp_path):
    """A dry run only warns about a file that is not here (it may be on the cluster)."""
    path = write_ids(tmp_path / "empty.bin", [])
    assert "an empty file" in refused(tmp_path, path, "dry_run=true")


def prepared(tmp_path: Path, ids: list[int], vocab: int) -> Path:
    """PREFIX.bin/.idx/.bin.json written as ``data prepare`` writes them, one document."""
    prefix = tmp_path / "tokens"
    with IndexedWriter(prefix, token_dtype(vocab)) as writer:
        writer.add(np.array(ids), [len(ids)])
        writer.commit({"vocab_size": vocab})
    return prefix.with_suffix(".bin")


def test_an_index_of_another_length_is_refused(tmp_path):
    path = prepared(tmp_path, list(range(200)), 256)
    with path.open("ab") as f:
        f.write(bytes(2))  # one uint16 token more than tokens.idx indexes
    line = refused(tmp_path, path)
    assert "tokens.idx indexes 200 tokens but the file holds 201 uint16 tokens" in line


def test_a_larger_vocabulary_than_the_model_is_refused(tmp_path):
    path = prepared(tmp_path, [1, 2, 3] * 100, 400)
    line = refused(tmp_path, path)
    assert "vocab_size 400 in tokens.bin.json, more than model.vocab_size=256" in line


def test_the_sidecar_largest_id_finds_what_a_sample_cannot(tmp_path):
    """A file larger than the sample, whose one bad id lies between the sampled pieces:
    the sidecar's max_token_id (what ``data prepare`` records) refuses it."""
    tokens = 3 * tokenfile.SAMPLE_BYTES // 2  # uint16: 6 MiB, sampled in pieces
    ids = np.zeros(tokens, np.uint16)
    piece = tokenfile.SAMPLE_BYTES // tokenfile.SAMPLE_PIECES // 2
    ids[piece + 10] = 300  # inside the gap after the first piece
    path = tmp_path / "big.bin"
    ids.tofile(path)
    layout = tokenfile.read_layout(path, 256)
    assert all(max(sampled) == 0 for _, sampled in tokenfile.sample(layout))
    (tmp_path / "big.bin.json").write_text(json.dumps({"dtype": "uint16", "max_token_id": 300}))
    line = refused(tmp_path, path)
    assert "its largest token id is 300 (max_token_id in big.bin.json), outside [0, 256)" in line


def test_data_prepare_records_the_largest_id_and_a_fitting_model_is_accepted(tmp_path):
    """``python -m axonn_launch.data prepare`` with a 400-id BPE: the sidecar's
    max_token_id is the largest id written; gpt_tiny with 512 ids takes the file."""
    tok = train_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "doc.txt").write_text(SHAKESPEARE.read_text()[:20_000])
    prefix = tmp_path / "corpus"
    argv = ["prepare", "--tokenizer", tok, "--input", tmp_path / "doc.txt", "--out", prefix,
            "--eod", "<|endoftext|>", "--workers", "1"]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    meta = json.loads(prefix.with_suffix(".bin.json").read_text())
    written = np.fromfile(prefix.with_suffix(".bin"), dtype=meta["dtype"])
    assert meta["max_token_id"] == int(written.max()) > 255
    work = tmp_path / "cwd"
    work.mkdir()
    args = [f"train.data={prefix}.bin", "model.vocab_size=512", "dry_run=true",
            f"hydra.run.dir={tmp_path / 'job'}"]  # fmt: skip
    proc = run_launcher(args, cwd=work)
    assert proc.returncode == 0 and "train.data" not in proc.stderr, proc.stderr


def train_tokenizer(path: Path) -> Path:
    """A byte-level BPE of 400 ids with an end-of-text token, trained on the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([SHAKESPEARE.read_text()[:50_000]], trainer)
    tok.save(str(path))
    return path


@pytest.mark.parametrize(
    ("layout", "model_vocab"),
    [("raw", 256), ("raw", 100_000), ("sidecar uint8", 256), ("idx int32", 256)],
)
def test_the_login_node_reads_the_dtype_and_bound_the_job_reads(tmp_path, layout, model_vocab):
    """``tokenfile.read_layout`` (no numpy) and the job's ``bin_dtype`` agree."""
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(64))
    if layout == "sidecar uint8":
        (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint8", "vocab_size": 200}))
    if layout == "idx int32":
        with IndexedWriter(tmp_path / "t", np.dtype(np.int32)) as writer:
            writer.add(np.zeros(16, np.int32), [16])
            writer.commit({})
    dtype, vocab = bin_dtype(path, model_vocab=model_vocab)
    found = tokenfile.read_layout(path, model_vocab)
    assert (found.dtype, found.vocab) == (dtype.name, vocab)
    assert tokenfile.problem("train.data", str(path), model_vocab) is None
