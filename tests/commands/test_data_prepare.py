"""``python -m axonn_launch.data``: tokenized documents in Megatron's indexed format, packed
fine-tuning data with a loss mask, and one-line errors that leave nothing behind.

The tokenizers are BPE models trained here on a slice of the built-in corpus (no downloads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from axonn_launch.common.corpus import TextTokenizer
from axonn_launch.common.indexed import MASK_SUFFIX, read_index
from axonn_launch.data import main
from axonn_launch.train.data import SHAKESPEARE, open_source
from tests.conftest import REPO

EOD = "<|endoftext|>"
SPECIALS = [EOD, "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DOCS = ["To be, or not to be:", "that is the question.\nWhether 'tis nobler", "in the mind"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 400) with an end-of-text and two chat tokens, no eos set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([SHAKESPEARE.read_text()[:100_000]], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tokenizer_json, tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory with an eos token and a ChatML chat template."""
    folder = tmp_path_factory.mktemp("hf")
    (folder / "tokenizer.json").write_text(tokenizer_json.read_text())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD,
              "chat_template": CHATML}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    """DOCS[0] in a.txt, DOCS[1:] as two lines of sub/b.jsonl (blank line between)."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS[0])
    lines = [json.dumps({"text": DOCS[1]}), "", json.dumps({"text": DOCS[2], "id": 7})]
    (root / "sub" / "b.jsonl").write_text("\n".join(lines) + "\n")
    return root


def fast(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def read_out(prefix: Path) -> tuple[np.ndarray, object]:
    index = read_index(prefix.with_suffix(".idx"))
    return np.fromfile(prefix.with_suffix(".bin"), dtype=index.dtype), index


def run(*argv: str) -> int:
    return main([str(a) for a in argv])


def test_prepare_writes_tokenizer_ids_plus_eod_with_megatron_index(tokenizer_json, corpus,
                                                                   tmp_path):  # fmt: skip
    out = tmp_path / "out" / "corpus"
    out.parent.mkdir()
    assert run("prepare", "--tokenizer", tokenizer_json, "--input", corpus, "--out", out,
               "--eod", EOD, "--workers", "1") == 0  # fmt: skip
    tok = fast(tokenizer_json)
    eod = tok.token_to_id(EOD)
    expected = [tok.encode(d).ids + [eod] for d in DOCS]  # a.txt, then sub/b.jsonl's lines
    tokens, index = read_out(out)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [t for doc in expected for t in doc]
    sizes = [len(d) for d in expected]
    assert index.sizes.tolist() == sizes
    assert index.pointers.tolist() == [2 * s for s in np.cumsum([0, *sizes[:-1]])]
    assert index.doc_indices.tolist() == [0, 1, 2, 3]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    assert index.document_starts().tolist() == starts
    meta = json.loads((out.parent / "corpus.bin.json").read_text())
    assert meta["vocab_size"] == 400 and meta["documents"] == 3 and meta["tokens"] == sum(sizes)
    whole = open_source(str(out.with_suffix(".bin")), model_vocab=400)
    assert whole.starts.tolist() == [s for s in starts if s < int(sum(sizes) * 0.9)]
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "corpus.bin", "corpus.bin.json", "corpus.idx",
    ]  # fmt: skip


def test_parallel_result_equals_serial(tokenizer_json, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    text = SHAKESPEARE.read_text()[:60_000]
    for i in range(6):  # 6 files of 10 kB, each one document
        (inputs / f"part{i}.txt").write_text(text[i * 10_000 : (i + 1) * 10_000])
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}"
        argv = ["prepare", "--tokenizer", tokenizer_json, "--input", inputs, "--out", out]
        assert run(*argv, "--eod", EOD, "--workers", workers) == 0
        outputs.append([(out.parent / (out.name + s)).read_bytes() for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    assert len(read_out(tmp_path / "w2")[1].sizes) == 6


def test_progress_lines_when_not_a_terminal(tokenizer_json, corpus, tmp_path, capsys):
    run("prepare", "--tokenizer", tokenizer_json, "--input", corpus, "--out", tmp_path / "o",
        "--eod", EOD)  # fmt: skip
    captured = capsys.readouterr()
    assert "tokenized 2/2 files" in captured.err
    assert captured.out.startswith(f"wrote {tmp_path / 'o'}.bin/.idx: 3 documents")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "case",
    [
        "missing input", "bad suffix", "empty dir", "no text", "not json", "no eos",
        "unknown eod", "no out dir", "no seq-len", "bad example", "no assistant",
        "unknown command", "zero workers", "no tokenizer", "not a tokenizer", "unknown option",
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tokenizer_json, corpus,
                                                         tmp_path, capsys):  # fmt: skip
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    good = ["--tokenizer", tokenizer_json, "--input", corpus, "--out", out_dir / "x", "--eod", EOD]
    bad_jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"txt": "oops"}])
    (tmp_path / "empty").mkdir()
    (tmp_path / "t.csv").write_text("a,b")
    (tmp_path / "junk.json").write_text("not a tokenizer")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    chats = write_jsonl(tmp_path / "ft.jsonl", [{"prompt": "p", "response": "r"}])
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "p", "answer": "r"}])
    mute = write_jsonl(tmp_path / "mute.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    argv = {
        "missing input": ["prepare", *good[:3], tmp_path / "nope.txt", *good[4:]],
        "bad suffix": ["prepare", *good[:3], tmp_path / "t.csv", *good[4:]],
        "empty dir": ["prepare", *good[:3], tmp_path / "empty", *good[4:]],
        "no text": ["prepare", *good[:3], corpus, bad_jsonl, *good[4:], "--workers", "2"],
        "not json": ["prepare", *good[:3], tmp_path / "bad.jsonl", *good[4:]],
        "no eos": ["prepare", *good[:-2]],
        "unknown eod": ["prepare", *good[:-1], "<|nope|>"],
        "no out dir": ["prepare", *good[:5], tmp_path / "missing" / "x", *good[6:]],
        "no seq-len": ["finetune", *good[:3], chats, *good[4:]],
        "bad example": ["finetune", *good[:3], wrong, *good[4:], "--seq-len", "16"],
        "no assistant": ["finetune", *good[:3], mute, *good[4:], "--seq-len", "16"],
        "unknown command": ["tokenize", *good],
        "zero workers": ["prepare", *good, "--workers", "0"],
        "no tokenizer": ["prepare", "--tokenizer", tmp_path / "none.json", *good[2:]],
        "not a tokenizer": ["prepare", "--tokenizer", tmp_path / "junk.json", *good[2:]],
        "unknown option": ["prepare", *good, "--shuffle"],
    }[case]
    capsys.readouterr()
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert list(out_dir.iterdir()) == []
    expect = {"missing input": "nope.txt", "no text": 'c.jsonl:2: expected a "text" string',
              "not json": "bad.jsonl:2: not JSON", "no eos": "--eod", "unknown eod": "<|nope|>",
              "no seq-len": "--seq-len", "bad example": "wrong.jsonl:1",
              "zero workers": "--workers=0", "unknown command": "tokenize"}  # fmt: skip
    assert expect.get(case, "") in err


def test_command_line_help_and_exit_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    command = [sys.executable, "-m", "axonn_launch.data"]
    shown = subprocess.run([*command, "--help"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m axonn_launch.data")
    assert "--seq-len S" in shown.stdout and "examples:" in shown.stdout
    bad = subprocess.run([*command, "prepare", "--tokenizer", "x.json", "--input", "y.txt",
                          "--out", str(tmp_path / "o")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ fine-tuning data


def read_packed(prefix: Path) -> tuple[np.ndarray, np.ndarray, object]:
    tokens, index = read_out(prefix)
    mask = np.fromfile(prefix.with_name(prefix.name + MASK_SUFFIX), dtype=np.uint8)
    return tokens, mask, index


def test_finetune_packs_whole_examples_and_masks_exactly_the_responses(tokenizer_json, tmp_path,
                                                                       capsys):  # fmt: skip
    tok = TextTokenizer(str(tokenizer_json), EOD)
    pairs = [("Who art thou?", "A friend."), ("Speak.", "I will, my lord."), ("Go.", "Anon!")]

    def example(prompt: str, response: str) -> tuple[list[int], list[int]]:  # the fallback
        head = tok.encode(f"user: {prompt}\n", special=False) + tok.encode(
            "assistant: ", special=False
        )
        body = tok.encode(response, special=False) + [tok.eod_id]
        return head + body, [0] * len(head) + [1] * len(body)

    examples = [example(*p) for p in pairs]
    seq = len(examples[0][0]) + len(examples[1][0])  # examples 0 and 1 fill one sequence exactly
    long_response = " ".join(["more"] * seq)
    rows = [{"prompt": p, "response": r} for p, r in pairs]
    rows.append({"messages": [{"role": "user", "content": "Tell"},
                              {"role": "assistant", "content": long_response}]})  # fmt: skip
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "sft"
    assert run("finetune", "--tokenizer", tokenizer_json, "--input", data, "--out", out,
               "--seq-len", seq - 1, "--eod", EOD) == 0  # fmt: skip
    assert "warning: 1 of 4 examples" in capsys.readouterr().err
    tokens, mask, index = read_packed(out)
    assert len(mask) == len(tokens) == 3 * seq
    (ids0, m0), (ids1, m1), (ids2, m2) = examples
    pad = seq - len(ids2)
    # each example is an index sequence (the padding one more); each packed row a document
    assert index.sizes.tolist() == [len(ids0), len(ids1), len(ids2), pad, seq]
    assert index.doc_indices.tolist() == [0, 2, 4, 5]
    assert index.document_starts().tolist() == [0, seq, 2 * seq]
    assert tokens[:seq].tolist() == ids0 + ids1 and mask[:seq].tolist() == m0 + m1
    assert tokens[seq : 2 * seq].tolist() == ids2 + [tok.eod_id] * pad
    assert mask[seq : 2 * seq].tolist() == m2 + [0] * pad
    truncated, _ = example("Tell", long_response)
    assert tokens[2 * seq :].tolist() == truncated[:seq]
    responses = [fast(tokenizer_json).decode(tokens[:seq][mask[:seq] == 1].tolist()[:-1])]
    assert responses[0].startswith("A friend.")
    meta = json.loads((tmp_path / "sft.bin.json").read_text())
    assert (meta["seq_len"], meta["examples"], meta["truncated"]) == (seq - 1, 4, 1)


def label_runs(tokens: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(tokens, mask)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


def test_chat_template_renders_messages_and_masks_assistant_turns(hf_dir, tmp_path):
    messages = [
        {"role": "system", "content": "Thou art a player."},
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay, answer me."},
        {"role": "user", "content": "Long live the king!"},
        {"role": "assistant", "content": "Bernardo?"},
    ]
    data = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": messages}, {"prompt": "Hi", "response": "Hail."}]
    )
    out = tmp_path / "chat"
    assert (
        run(
            "finetune",
            "--tokenizer",
            hf_dir,
            "--input",
            data,
            "--out",
            out,
            "--seq-len",
            127,
            "--workers",
            "1",
        )
        == 0
    )  # fmt: skip (no --eod: the config's)
    tokens, mask, index = read_packed(out)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    eod = hf.convert_tokens_to_ids(EOD)
    rendered = hf.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nThou art a player.<|im_end|>\n")
    first = tokens.tolist()[: tokens.tolist().index(eod) + 1]
    assert hf.decode(first) == rendered + EOD
    runs = [hf.decode(r) for r in label_runs(first, mask[: len(first)].tolist())]
    assert runs == ["Nay, answer me.<|im_end|>\n", f"Bernardo?<|im_end|>\n{EOD}"]
    second = tokens.tolist()[len(first) :]
    text = hf.decode(second[: second.index(eod) + 1])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHail.<|im_end|>\n" + EOD
    second_len = second.index(eod) + 1
    assert index.sizes.tolist() == [len(first), second_len, 128 - len(first) - second_len]
    assert index.document_starts().tolist() == [0]


def test_hf_directory_gives_the_eos_token_for_prepare(hf_dir, corpus, tmp_path):
    out = tmp_path / "o"
    assert run("prepare", "--tokenizer", hf_dir, "--input", corpus, "--out", out,
               "--workers", "1") == 0  # fmt: skip
    tokens, index = read_out(out)
    eod = fast(hf_dir / "tokenizer.json").token_to_id(EOD)
    assert [tokens[s + n - 1] for s, n in zip(index.document_starts(), index.sizes)] == [eod] * 3
