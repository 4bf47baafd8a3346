"""Tokenize text into Megatron indexed datasets; pack fine-tuning data with a loss mask.

The command (``prepare``, ``finetune``; ``--help`` shows both): it writes ``PREFIX.bin``,
``PREFIX.idx``, ``PREFIX.bin.json`` and, for ``finetune``, ``PREFIX.mask``. The tokenizer,
the inputs and the packer are ``common/corpus.py``; the writer and the reader of the format
``common/indexed.py``. No torch.

The files, packing and parallel tokenizing: ``docs/data.md`` ("data.py").
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from axonn_launch.common.corpus import (
    DataError,
    Packer,
    TextTokenizer,
    conversation,
    documents,
    encode_example,
    json_lines,
)
from axonn_launch.common.indexed import MASK_SUFFIX, IndexedWriter, token_dtype
from axonn_launch.usage import help_page, raising_parser, run_tool, wants_help

TEXT_SUFFIXES = (".txt", ".jsonl")
LOG_EVERY_FILES = 100  # progress lines when stderr is not a terminal

HELP = help_page(
    usage=(
        "python -m axonn_launch.data {prepare|finetune} --tokenizer TOK --input PATH... "
        "--out PREFIX [--seq-len S] [--workers N] [--eod TOKEN]"
    ),
    summary=(
        "prepare: tokenize documents (a .txt file is one; a .jsonl line {'text': ...} is one),\n"
        "append the end-of-document token, write PREFIX.bin/.idx (Megatron indexed dataset).\n"
        "finetune: tokenize {'prompt','response'} or {'messages': [...]} lines (the\n"
        "tokenizer's chat template, else 'role: content' lines), pack them into sequences of\n"
        "S+1 tokens and write PREFIX.bin/.idx plus PREFIX.mask (1 = response token, in the loss).\n"
        "Use the result with train.data=PREFIX.bin."
    ),
    keys=[
        ("prepare|finetune", "the command"),
        ("--tokenizer TOK", "a tokenizer.json file or a Hugging Face tokenizer directory"),
        ("--input PATH...", ".txt/.jsonl files or directories of them (finetune: .jsonl)"),
        ("--out PREFIX", "writes PREFIX.bin, PREFIX.idx, PREFIX.bin.json (+ PREFIX.mask)"),
        ("--seq-len S", "finetune: training sequence length (packed sequences hold S+1)"),
        ("--workers N", "processes tokenizing files in parallel (default: CPUs, at most files)"),
        ("--eod TOKEN", "the end-of-document token (default: the tokenizer's eos token)"),
        ("--debug", "show the traceback of an error"),
    ],
    examples=[
        "python -m axonn_launch.data prepare --tokenizer gpt2/tokenizer.json --eod '<|endoftext|>'"
        " --input corpus/ --out data/corpus",
        "python -m axonn_launch.data finetune --tokenizer llama3_dir --input chats.jsonl"
        " --out data/chats --seq-len 2048",
    ],
)


# ------------------------------------------------------------------ reading inputs


def expand_inputs(paths: Sequence[str], suffixes: tuple[str, ...]) -> list[Path]:
    """The files named by ``paths`` (directories: their matching files, recursively)."""
    files: list[Path] = []
    allowed = "/".join(suffixes)
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
            if not found:
                raise DataError(f"--input={text!r}: directory holds no {allowed} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in suffixes:
                raise DataError(f"--input={text!r}: expected a {allowed} file or a directory")
            files.append(path)
        else:
            raise DataError(f"--input={text!r}: no such file or directory")
    return files


# ------------------------------------------------------------------ workers

_worker: TextTokenizer | None = None


def _init_worker(path: str, eod: str | None) -> None:
    global _worker
    _worker = TextTokenizer(path, eod)


def tokenize_documents(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, sizes) of every document of one file, each ending with eod."""
    tok = _worker
    docs = [tok.encode(text) + [tok.eod_id] for text in documents(path)]
    sizes = np.array([len(d) for d in docs], dtype=np.int64)
    return np.fromiter((t for d in docs for t in d), np.int64, int(sizes.sum())), sizes


def tokenize_examples(path: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every fine-tuning example of one .jsonl file."""
    return [encode_example(_worker, conversation(path, n, v)) for n, v in json_lines(path)]


def map_files(func: Callable, files: list[Path], tok: TextTokenizer, eod: str | None,
              workers: int) -> Iterator:  # fmt: skip
    """``func(file)`` for each file in order; in ``workers`` processes when more than one."""
    global _worker
    if workers <= 1:
        _worker = tok
        yield from map(func, files)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # the tokenizers' threads do not fork
    with context.Pool(workers, _init_worker, (tok.path, eod)) as pool:
        yield from pool.imap(func, files, chunksize=1)


class Progress:
    """A bar on a terminal; elsewhere a line every ``every`` files and at the end."""

    def __init__(self, total: int, *, stream=None, every: int = LOG_EVERY_FILES) -> None:
        self.total, self.every, self.done, self.tokens = total, every, 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        text = f"{self.done}/{self.total} files, {self.tokens:,} tokens"
        if self.tty:
            filled = 30 * self.done // self.total
            end = "\n" if self.done == self.total else ""
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}", end=end, file=self.stream)
        elif self.done % self.every == 0 or self.done == self.total:
            print(f"tokenized {text}", file=self.stream)
        self.stream.flush()


# ------------------------------------------------------------------ the commands


def prepare(tok: TextTokenizer, files: list[Path], out: Path, *, eod: str | None,
            workers: int) -> dict:  # fmt: skip
    """Tokenize ``files`` into ``out``.bin/.idx; the sidecar's summary."""
    progress = Progress(len(files))
    with IndexedWriter(out, token_dtype(tok.vocab_size)) as writer:
        for tokens, sizes in map_files(tokenize_documents, files, tok, eod, workers):
            writer.add(tokens, sizes)
            progress.update(len(tokens))
        return writer.commit({"vocab_size": tok.vocab_size, "tokenizer": tok.path})


def finetune(tok: TextTokenizer, files: list[Path], out: Path, *, seq_len: int,
             eod: str | None, workers: int) -> dict:  # fmt: skip
    """Pack the examples of ``files`` into ``out``.bin/.idx/.mask; the sidecar's summary."""
    progress = Progress(len(files))
    examples = labels = 0
    with IndexedWriter(out, token_dtype(tok.vocab_size), masked=True) as writer:
        packer = Packer(seq_len + 1, tok.eod_id,
                        lambda t, m, sizes: writer.add(t, sizes, m, one_document=True))  # fmt: skip
        for file_examples in map_files(tokenize_examples, files, tok, eod, workers):
            for ids, mask in file_examples:
                packer.add(ids, mask)
                labels += sum(mask)
            examples += len(file_examples)
            progress.update(sum(len(ids) for ids, _ in file_examples))
        packer.flush()
        if not examples:
            raise DataError(f"--input: no examples in {', '.join(map(str, files))}")
        meta = {"vocab_size": tok.vocab_size, "tokenizer": tok.path, "seq_len": seq_len,
                "examples": examples, "truncated": packer.truncated,
                "padding_tokens": packer.padding}  # fmt: skip
        meta = writer.commit(meta)
    if packer.truncated:
        print(f"warning: {packer.truncated} of {examples} examples were longer than "
              f"{seq_len + 1} tokens and were truncated", file=sys.stderr)  # fmt: skip
    return {**meta, "label_tokens": labels}


_Parser = raising_parser(DataError, " (see --help)")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m axonn_launch.data", add_help=False, exit_on_error=False)
    parser.add_argument("command", choices=["prepare", "finetune"])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--input", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--eod")
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise DataError(f"{exc} (see --help)") from None
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be checked before tokenizing."""
    if args.command == "finetune" and (args.seq_len is None or args.seq_len < 1):
        raise DataError(f"--seq-len={args.seq_len}: finetune needs a sequence length >= 1")
    if args.command == "prepare" and args.seq_len is not None:
        raise DataError(f"--seq-len={args.seq_len}: only finetune packs sequences")
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers={args.workers}: expected a number of processes >= 1")
    out = Path(args.out)
    if not out.name or out.is_dir():
        raise DataError(f"--out={args.out!r}: expected a file prefix such as data/corpus")
    if not out.parent.is_dir():
        raise DataError(f"--out={args.out!r}: directory {str(out.parent)!r} does not exist")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    return run_tool(_main, argv, (DataError,))


def _main(argv: list[str]) -> int:
    args = parse(argv)
    suffixes = (".jsonl",) if args.command == "finetune" else TEXT_SUFFIXES
    files = expand_inputs(args.input, suffixes)
    tok = TextTokenizer(args.tokenizer, args.eod)
    workers = min(args.workers or os.cpu_count() or 1, len(files))
    out = Path(args.out)
    if args.command == "prepare":
        meta = prepare(tok, files, out, eod=args.eod, workers=workers)
    else:
        meta = finetune(tok, files, out, seq_len=args.seq_len, eod=args.eod, workers=workers)
    print(summary_line(out, meta))
    return 0


def summary_line(out: Path, meta: dict) -> str:
    text = f"wrote {out}.bin/.idx: {meta['documents']:,} documents, {meta['tokens']:,} tokens"
    if "seq_len" in meta:
        text += (f" ({meta['examples']:,} examples packed into sequences of "
                 f"{meta['seq_len'] + 1}; {meta['label_tokens']:,} label tokens in {out}"
                 f"{MASK_SUFFIX})")  # fmt: skip
    return text


if __name__ == "__main__":
    sys.exit(main())
