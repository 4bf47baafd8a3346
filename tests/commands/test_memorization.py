"""The memorization metric: the metric functions on hand-computed cases, and the CLI's
reading, prompting, scoring and output with a stand-in generator whose answers are known."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from axonn_launch import memorization as mem
from axonn_launch.common import memorization_metric as metric
from tests.cli_server import run_module
from tests.conftest import REPO

# ------------------------------------------------------------------------------ metrics


def test_exact_and_token_match():
    assert metric.exact_match([1, 2, 3], [1, 2, 3])
    assert not metric.exact_match([1, 2], [1, 2, 3])  # stopped early: no match
    assert not metric.exact_match([1, 2, 4], [1, 2, 3])
    assert metric.token_match([1, 9, 3, 9], [1, 2, 3, 4]) == 0.5
    assert metric.token_match([1, 2], [1, 2, 3, 4]) == 0.5  # missing positions are wrong
    assert metric.token_match([], [5]) == 0.0


@pytest.mark.parametrize(
    ("a", "b", "lcs"),
    [
        ("ABCBDAB", "BDCABA", 4),  # CLRS: BCBA
        ("AGGTAB", "GXTXAYB", 4),  # GTAB
        ("abc", "def", 0),
        ("", "abc", 0),
        ("abcd", "abcd", 4),
    ],
)
def test_lcs_length(a, b, lcs):
    assert metric.lcs_length(list(a), list(b)) == lcs == metric.lcs_length(list(b), list(a))


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat lay on a mat") = the cat on mat = 4
    pred = ["the", "cat", "sat", "on", "the", "mat"]
    truth = ["the", "cat", "lay", "on", "a", "mat"]
    p, r = 4 / 6, 4 / 6
    assert metric.rouge_l(pred, truth) == pytest.approx(2 * p * r / (p + r))
    # different lengths: LCS(1 2 3 4 5, 1 3 5) = 3; P = 3/5, R = 1 -> F = 0.75
    assert metric.rouge_l([1, 2, 3, 4, 5], [1, 3, 5]) == pytest.approx(0.75)
    assert metric.rouge_l([1, 2], [3, 4]) == 0.0
    assert metric.rouge_l([], [1]) == 0.0


def test_rouge_words_is_rouge_scores_default_tokenizer():
    assert metric.rouge_words("Hello, World! It's 2024\nO'er") == [
        "hello",
        "world",
        "it",
        "s",
        "2024",
        "o",
        "er",
    ]


def test_split_document():
    assert metric.split_document(list(range(10)), 3) == (list(range(7)), [7, 8, 9])
    assert metric.split_document(list(range(4)), 3) == ([0], [1, 2, 3])
    assert metric.split_document(list(range(3)), 3) is None  # no prompt left: skipped


def test_summarize():
    rows = [
        {"exact_match": True, "token_match": 1.0, "rouge_l": 1.0},
        {"exact_match": False, "token_match": 0.5, "rouge_l": 0.25},
    ]
    assert metric.summarize(rows, skipped=3) == {
        "exact_match_rate": 0.5,
        "token_match": 0.75,
        "rouge_l": 0.625,
        "n_documents": 2,
        "skipped": 3,
    }
    assert metric.summarize([], 1)["exact_match_rate"] is None


# --------------------------------------------------------------- the CLI, stand-in model


def truth_for(documents: list[list[int]], n: int, corrupt: set[int], calls: list) -> mem.Generator:
    """A generator that knows the documents: the truth, or for documents whose index is in
    ``corrupt`` the truth with every other token replaced."""
    by_prompt = {tuple(d[:-n]): d[-n:] for d in documents}

    def generate(source, prompts, *, max_new_tokens, overrides, temperature=0.0, top_k=0):
        calls.append(
            {
                "source": source,
                "n": len(prompts),
                "max_new_tokens": max_new_tokens,
                "overrides": overrides,
                "temperature": temperature,
                "top_k": top_k,
            }
        )
        outputs = []
        for prompt in prompts:
            truth = by_prompt[tuple(prompt["ids"])]
            doc = next(i for i, d in enumerate(documents) if tuple(d[:-n]) == tuple(prompt["ids"]))
            out = [t if j % 2 or doc not in corrupt else 999 for j, t in enumerate(truth)]
            outputs.append({"prompt_ids": prompt["ids"], "output_ids": out, "text": ""})
        return outputs

    return generate


@pytest.fixture
def job_source(tmp_path) -> Path:
    """A stand-in job directory of a byte-level model (its spec.json is what matters)."""
    job = tmp_path / "job"
    (job / "checkpoints" / "step_00000006").mkdir(parents=True)
    (job / "spec.json").write_text(json.dumps({"model": {"vocab_size": 256}}))
    return job


def documents_of(rng: np.random.Generator, lengths: list[int], vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def test_cli_rates_with_known_answers(tmp_path, job_source, capsys):
    rng = np.random.default_rng(0)
    docs = documents_of(rng, [30, 12, 5, 40, 9, 25], 256)  # 5 and 9 tokens: too short for N=10
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"ids": d}) for d in docs) + "\n")
    calls: list = []
    generate = truth_for([d for d in docs if len(d) > 10], 10, corrupt={1, 3}, calls=calls)
    out = tmp_path / "res" / "memorization.json"
    code = mem.main(
        [
            str(job_source / "checkpoints" / "step_00000006"),
            f"data={data}",
            "continuation=10",
            f"out={out}",
            "grid.x=2",
            "machine=local",
        ],
        generate,
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["n_documents"] == 4 and result["skipped"] == 2
    assert result["exact_match_rate"] == 0.5  # documents 0 and 2 of the 4 scored are exact
    assert result["token_match"] == pytest.approx((1 + 0.5 + 1 + 0.5) / 4)
    assert [r["document"] for r in result["documents"]] == [0, 1, 3, 5]
    assert [r["exact_match"] for r in result["documents"]] == [True, False, True, False]
    assert result["rouge_on"] == "words"  # the byte-level model decodes
    assert calls == [
        {
            "source": str(job_source / "checkpoints" / "step_00000006"),
            "n": 4,
            "max_new_tokens": 10,
            "overrides": ["grid.x=2", "machine=local"],
            "temperature": 0.0,
            "top_k": 0,
        }
    ]
    printed = capsys.readouterr().out
    assert "4 documents (2 skipped, too short): exact match 0.500, token match 0.750" in printed


def test_text_documents_and_word_rouge(tmp_path, job_source):
    texts = ["To be, or not to be, that is the question", "Now is the winter of our discontent"]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    n = 12
    docs = [list(t.encode()) for t in texts]

    def generate(source, prompts, *, max_new_tokens, overrides, temperature=0.0, top_k=0):
        # document 0: exact; document 1: "discontent" -> "DISCONTENT!" (same words, lowercase)
        outs = [docs[0][-n:], list(b"r discontent".upper())]
        return [
            {"prompt_ids": p["ids"], "output_ids": o, "text": ""} for p, o in zip(prompts, outs)
        ]

    settings = metric.Settings(
        source=str(job_source), data=str(data), out=str(tmp_path / "o.json"), continuation=n
    )
    result = mem.measure(settings, generate)
    rows = result["documents"]
    assert rows[0]["truth_text"] == "the question" and rows[0]["exact_match"]
    assert rows[1]["truth_text"] == "r discontent" and not rows[1]["exact_match"]
    assert rows[1]["rouge_l"] == 1.0  # rouge_score's words ignore case
    assert rows[1]["token_match"] == pytest.approx(1 / 12)  # only the space is unchanged


def test_ids_only_model_scores_rouge_on_ids(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"ids": [5, 6, 7, 8, 9, 10]}))

    def generate(source, prompts, *, max_new_tokens, overrides, temperature=0.0, top_k=0):
        return [{"prompt_ids": p["ids"], "output_ids": [7, 99, 9, 8], "text": ""} for p in prompts]

    result = mem.measure(
        metric.Settings(str(source), str(data), str(tmp_path / "o.json"), 4), generate
    )
    assert result["rouge_on"] == "token ids"
    # truth 7 8 9 10, pred 7 99 9 8: LCS = 2 (7 9 or 7 8) -> F = 0.5
    assert result["rouge_l"] == 0.5 and result["token_match"] == 0.5


def write_megatron(path: Path, docs: list[list[int]]) -> None:
    """A Megatron .bin/.idx pair (MMIDIDX version 1, uint16 tokens)."""
    np.concatenate([np.array(d, dtype=np.uint16) for d in docs]).tofile(path)
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * 2]).astype(np.int64)
    with path.with_suffix(".idx").open("wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(
            sizes.tobytes()
            + pointers.tobytes()
            + np.arange(len(docs) + 1).astype(np.int64).tobytes()
        )


def test_bin_with_idx_documents(tmp_path):
    docs = documents_of(np.random.default_rng(1), [7, 20, 3, 11], 50000)
    write_megatron(tmp_path / "t.bin", docs)
    assert [d.tolist() for d in metric.read_documents(tmp_path / "t.bin", None)] == docs


def test_bin_without_idx_is_cut_into_chunks(tmp_path):
    tokens = np.arange(25, dtype=np.uint32)
    tokens.tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 100}))
    docs = [d.tolist() for d in metric.read_documents(tmp_path / "t.bin", None, chunk=10)]
    assert docs == [list(range(10)), list(range(10, 20)), list(range(20, 25))]


def test_max_length_and_max_documents():
    docs = [list(range(100)), list(range(4)), list(range(30)), list(range(40))]
    settings = metric.Settings("s", "d", "o", continuation=4, max_documents=2, max_length=20)
    prompts, skipped = metric.build_prompts(docs, settings)
    assert [p["document"] for p in prompts] == [0, 2] and skipped == 1
    assert prompts[0]["ids"] == list(range(16)) and prompts[0]["truth"] == [16, 17, 18, 19]


# ------------------------------------------------------------------------- bad input


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.memorization", list(argv), cwd=cwd, timeout=60)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{src}", "data={tmp}/none.jsonl", "out=o.json"], "data={tmp}/none.jsonl: no such file"),
        (
            ["{src}", "data={tmp}/d.jsonl", "out=o.json", "continuation=0"],
            "continuation=0: expected a positive integer",
        ),
        (
            ["{src}", "data={tmp}/d.jsonl", "out=o.json", "temperature=1"],
            "temperature=1: unknown key",
        ),
        (["{src}", "out=o.json"], "data= is required"),
        (["{src}", "data={tmp}/d.jsonl", "out=o.json", "batch_size=x"], "batch_size=x: expected"),
        (["{src}", "data={tmp}/bad.jsonl", "out=o.json"], "bad.jsonl:2: not JSON"),
        (["{tmp}/missing", "data={tmp}/d.jsonl", "out=o.json"], "not a directory"),
        (["{tmp}/hf", "data={tmp}/t.jsonl", "out=o.json"], "a text document needs a tokenizer"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    (tmp_path / "hf").mkdir()
    (tmp_path / "d.jsonl").write_text('{"ids": [1, 2, 3]}\n')
    (tmp_path / "t.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "bad.jsonl").write_text('{"ids": [1, 2, 3]}\n{"ids": [1,\n')
    fill = {"src": str(tmp_path / "hf"), "tmp": str(tmp_path)}
    proc = run_cli(*[a.format(**fill) for a in args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message.format(**fill) in proc.stderr


def test_help(tmp_path):
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(
        "usage: python -m axonn_launch.memorization"
    )
    assert REPO.exists()


def test_bin_of_a_large_vocab_is_read_as_uint32(tmp_path):
    """No .idx, no sidecar: the model's vocab (> 65,536) makes it uint32, as the job reads it."""
    tokens = np.array([70_000, 5, 99_999, 65_536, 1], dtype=np.uint32)
    tokens.tofile(tmp_path / "t.bin")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 100_000}))
    vocab = metric.model_vocab(tmp_path / "model")
    docs = metric.read_documents(tmp_path / "t.bin", None, chunk=3, model_vocab=vocab)
    assert [d.tolist() for d in docs] == [[70_000, 5, 99_999], [65_536, 1]]


def test_bin_with_no_dtype_and_no_vocab_is_refused(tmp_path):
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(metric.MemorizationError, match="names its dtype"):
        metric.read_documents(tmp_path / "t.bin", None)
