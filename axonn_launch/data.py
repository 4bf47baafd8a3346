"""Tokenize text into Megatron indexed datasets; pack fine-tuning data with a loss mask.

    python -m axonn_launch.data prepare --tokenizer TOK --input PATH... --out PREFIX
    python -m axonn_launch.data finetune --tokenizer TOK --input FILE.jsonl... --out PREFIX \\
        --seq-len S

``TOK`` is a ``tokenizer.json`` (the ``tokenizers`` library) or a Hugging Face tokenizer
directory (loaded with ``transformers.AutoTokenizer``; its ``chat_template`` renders
conversations). Both commands write ``PREFIX.bin`` (token ids), ``PREFIX.idx`` (Megatron's
``MMapIndexedDataset`` index: header, version, dtype code, sequence and document counts,
then sizes, byte pointers and document indices) and ``PREFIX.bin.json`` (dtype, vocab
size, the largest token id, counts; the launcher and the job check them against the
model's vocabulary). ``finetune`` also writes ``PREFIX.mask``: one uint8 per token, 1 where
the token counts as a label (a response token or the end-of-turn token after it), 0 for
prompts and padding. Its documents are the packed sequences of ``S + 1`` tokens each: whole examples
in order, padded with the end-of-document token; an example longer than ``S + 1`` is
truncated (and counted in a warning). Each example is a sequence of the index (and the
padding one more), so a document lists the examples it packs, Megatron's distinction
between sequences and documents: the job keeps each example's attention and positions to
itself. ``prepare`` writes one sequence per document.

Files are tokenized in parallel (one file per task); the output is the same for any
``--workers``. Everything is written under temporary names and renamed at the end, so an
error leaves nothing behind. This module never imports torch: the job side reads the
index format from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from axonn_launch.common.indexed import (
    MASK_SUFFIX,
    index_bytes,
    token_dtype,
)
from axonn_launch.usage import help_page, raising_parser, run_tool, wants_help

TEXT_SUFFIXES = (".txt", ".jsonl")
ASSISTANT = "assistant"
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


class DataError(ValueError):
    """A user's mistake: one line, exit code 2."""


# ------------------------------------------------------------------ the index format


class IndexedWriter:
    """Writes PREFIX.bin (+ .mask), then .idx and .bin.json; all under temporary names
    until ``commit``; ``abort`` (or an exception in a ``with`` block) removes them."""

    def __init__(self, prefix: Path, dtype: np.dtype, *, masked: bool = False) -> None:
        self.prefix = prefix
        self.dtype = dtype
        self.sizes: list[np.ndarray] = []
        self.firsts: list[int] = []  # the sequence each document starts with
        self.sequences = 0
        self.max_id = -1  # the largest token id written (the sidecar's max_token_id)
        self.names = [".bin", ".idx", ".bin.json"] + ([MASK_SUFFIX] if masked else [])
        self.tmp = {s: prefix.with_name(f".{prefix.name}{s}.tmp{os.getpid()}") for s in self.names}
        self.bin = self.tmp[".bin"].open("wb")
        self.mask = self.tmp[MASK_SUFFIX].open("wb") if masked else None

    def add(
        self,
        tokens: np.ndarray,
        sizes: Sequence[int],
        mask: np.ndarray | None = None,
        *,
        one_document: bool = False,
    ) -> None:
        """Sequences of ``sizes`` tokens, concatenated in ``tokens``: each a document, or
        with ``one_document`` together one."""
        ids = np.asarray(tokens, dtype=self.dtype)
        self.bin.write(ids.tobytes())
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        if self.mask is not None:
            self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.sizes.append(np.asarray(sizes, dtype=np.int64))
        starts = range(self.sequences, self.sequences + (1 if one_document else len(sizes)))
        self.firsts.extend(starts)
        self.sequences += len(sizes)

    def commit(self, meta: dict) -> dict:
        """Write the index and sidecar, rename everything into place; the sidecar's dict."""
        self._close()
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, dtype=np.int64)
        self.tmp[".idx"].write_bytes(index_bytes(sizes, self.dtype, np.array(self.firsts)))
        meta = {"dtype": self.dtype.name, **meta, "documents": len(self.firsts),
                "tokens": int(sizes.sum())}  # fmt: skip
        if self.max_id >= 0:  # the launcher checks it against the model's vocabulary
            meta["max_token_id"] = self.max_id
        self.tmp[".bin.json"].write_text(json.dumps(meta, indent=1) + "\n")
        for suffix in sorted(self.names, key=lambda s: s == ".bin"):  # the .bin last
            self.tmp[suffix].replace(self.prefix.with_name(self.prefix.name + suffix))
        return meta

    def abort(self) -> None:
        self._close()
        for path in self.tmp.values():
            path.unlink(missing_ok=True)

    def _close(self) -> None:
        for handle in (self.bin, self.mask):
            if handle is not None:
                handle.close()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()


# ------------------------------------------------------------------ tokenizers


class TextTokenizer:
    """A ``tokenizer.json`` (tokenizers) or an HF directory (transformers), one interface."""

    def __init__(self, path: str, eod: str | None = None) -> None:
        self.path = path
        source = Path(path)
        if source.is_dir():
            self._hf = _auto_tokenizer(source)
            self._fast = None
            self.vocab_size = len(self._hf)
            self.chat_template = getattr(self._hf, "chat_template", None) or None
            default_eod = self._hf.eos_token_id
        elif source.is_file():
            self._hf = None
            self._fast = _fast_tokenizer(source)
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            self.chat_template = None
            default_eod = None
        else:
            raise DataError(f"--tokenizer={path!r}: no such file or directory")
        self.eod_id = self._eod(eod) if eod is not None else default_eod
        if self.eod_id is None:
            raise DataError(
                f"--tokenizer={path!r} has no eos token: name the end-of-document token "
                "with --eod TOKEN (e.g. --eod '<|endoftext|>')"
            )

    def _eod(self, eod: str) -> int:
        vocab = self._hf.get_vocab() if self._hf is not None else self._fast.get_vocab(True)
        if eod in vocab:
            return int(vocab[eod])
        if eod.isdigit() and int(eod) < self.vocab_size:
            return int(eod)
        raise DataError(
            f"--eod={eod!r}: not a token of {self.path!r}; give a token string of its "
            f"vocabulary or an id below {self.vocab_size}"
        )

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids; ``special``: with the tokenizer's automatic tokens (e.g. a BOS)."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=special))
        return self._fast.encode(text, add_special_tokens=special).ids

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` (as text)."""
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )


def _fast_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises plain Exceptions for bad files
        raise DataError(f"--tokenizer={str(path)!r}: not a tokenizer.json ({exc})") from None


def _auto_tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            f"--tokenizer={str(path)!r} is a directory: that needs transformers "
            "(pip install -e '.[hf]'), or pass its tokenizer.json"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many kinds for a bad directory
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"--tokenizer={str(path)!r}: not a tokenizer directory ({why})") from None


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


def json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a .jsonl file."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {value!r:.40}")
            yield number, value


def documents(path: Path) -> Iterator[str]:
    """A .txt file is one document; each .jsonl line's "text" is one."""
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
        return
    for number, value in json_lines(path):
        text = value.get("text")
        if not isinstance(text, str):
            raise DataError(f'{path}:{number}: expected a "text" string, got keys {sorted(value)}')
        yield text


def conversation(path: Path, number: int, value: dict) -> list[dict]:
    """The messages of one fine-tuning line ({prompt, response} is user + assistant)."""
    where = f"{path}:{number}"
    if "messages" in value:
        messages = value["messages"]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages
        )  # fmt: skip
        if not ok:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of "
                            "{\"role\": str, \"content\": str}")  # fmt: skip
        if not any(m["role"] == ASSISTANT for m in messages):
            raise DataError(f"{where}: no {ASSISTANT!r} message, so nothing to learn")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(value.get("prompt"), str) and isinstance(value.get("response"), str):
        return [{"role": "user", "content": value["prompt"]},
                {"role": ASSISTANT, "content": value["response"]}]  # fmt: skip
    raise DataError(
        f'{where}: expected {{"prompt": str, "response": str}} or {{"messages": [...]}}, '
        f"got keys {sorted(value)}"
    )


# ------------------------------------------------------------------ fine-tuning examples


def encode_example(tok: TextTokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation; mask 1 on what the assistant says and ends with.

    Each piece of text is tokenized on its own (no automatic special tokens: a chat
    template writes its BOS itself), so no token straddles a prompt/response boundary.
    """
    ids: list[int] = []
    mask: list[int] = []
    for text, label in segments(tok, messages):
        piece = [tok.eod_id] if text is None else tok.encode(text, special=False)
        ids += piece
        mask += [label] * len(piece)
    if not ids or ids[-1] != tok.eod_id:  # every example ends with the end-of-document token
        ids.append(tok.eod_id)
        mask.append(int(messages[-1]["role"] == ASSISTANT))
    return ids, mask


def segments(tok: TextTokenizer, messages: list[dict]) -> list[tuple[str | None, int]]:
    """(text or None for the eod token, label) pieces of a conversation, in order."""
    if tok.chat_template is None:
        return fallback_segments(messages)
    full = tok.render(messages, generation_prompt=False)
    pieces, cursor = [], 0
    for begin, end in assistant_spans(tok, messages, full):
        pieces += [(full[cursor:begin], 0), (full[begin:end], 1)]
        cursor = end
    return [*pieces, (full[cursor:], 0)]


def fallback_segments(messages: list[dict]) -> list[tuple[str | None, int]]:
    """Without a chat template: ``role: content`` lines; an assistant turn ends in eod."""
    pieces: list[tuple[str | None, int]] = []
    for m in messages:
        if m["role"] == ASSISTANT:
            pieces += [(f"{ASSISTANT}: ", 0), (m["content"], 1), (None, 1)]
        else:
            pieces.append((f"{m['role']}: {m['content']}\n", 0))
    return pieces


def assistant_spans(tok: TextTokenizer, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn in the rendered conversation ``full``.

    A turn is what rendering ``messages[:i+1]`` adds to ``messages[:i]`` with the
    generation prompt (its content and end-of-turn markup). A template whose renderings
    are not prefixes of each other gets the content's own span instead.
    """
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        before = tok.render(messages[:i], generation_prompt=True) if i else ""
        upto = tok.render(messages[: i + 1], generation_prompt=False)
        if full.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
            span = (len(before), len(upto))
        else:
            begin = full.find(m["content"], cursor)
            if begin < 0:
                raise DataError(f"the chat template of {tok.path!r} drops an assistant message")
            span = (begin, begin + len(m["content"]))
        spans.append(span)
        cursor = span[1]
    return spans


@dataclass
class Packer:
    """Whole examples into sequences of ``length`` tokens, in order, padded with ``pad``."""

    length: int
    pad: int
    emit: Callable[[np.ndarray, np.ndarray, list[int]], None]  # (tokens, mask, example sizes)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    truncated: int = 0
    padding: int = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        if len(self.ids) + len(ids) > self.length:
            self.flush()
        if len(ids) > self.length:
            self.truncated += 1
            ids, mask = ids[: self.length], mask[: self.length]
        self.ids += ids
        self.mask += mask
        self.sizes.append(len(ids))

    def flush(self) -> None:
        """Emit the sequence so far, padded; the padding is one more example's size."""
        if not self.ids:
            return
        fill = self.length - len(self.ids)
        self.padding += fill
        sizes = self.sizes + [fill] * (fill > 0)
        self.emit(np.array(self.ids + [self.pad] * fill), np.array(self.mask + [0] * fill), sizes)
        self.ids, self.mask, self.sizes = [], [], []


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
