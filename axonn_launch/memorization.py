"""Memorization of training documents: greedy continuations scored against the truth.

The measurement of the Goldfish study (Hans et al. 2024, arXiv 2406.10209; goldfish-loss
``eval/data_extraction.py``): each document is cut to its first ``max_length`` tokens
(default 2048); documents of at most ``continuation`` tokens are skipped and counted; the
last ``continuation`` tokens (N, default 50) are the truth, everything before them the
prompt. The model continues each prompt greedily by N tokens and every document gets

- ``exact_match``: all N generated ids equal the truth (a shorter output is no match);
- ``token_match``: the fraction of the N positions whose ids are equal;
- ``rouge_l``: ROUGE-L F-measure (LCS-based, β = 1). The reference scores decoded text
  with ``evaluate.load("rouge")``, i.e. rouge_score's default tokenizer: lowercase
  ``[a-z0-9]+`` words, no stemming. We do the same when the model has a tokenizer to decode
  with (an HF dir's ``tokenizer.json``, or our byte-level models), so the numbers compare
  with the paper's; otherwise on token ids (``rouge_on`` in the output says which).

Data (``data=``): a ``.jsonl`` of ``{"ids": [...]}`` or ``{"text": "..."}`` (text needs a
tokenizer), or a token ``.bin``: with a Megatron ``.idx`` beside it each indexed sequence is
a document; without one the stream is cut into consecutive chunks of ``chunk`` tokens
(default 2048, the reference's ``max_length``), each a document — a flat ``.bin`` has no
boundaries to recover. Its dtype comes from the ``.idx``, the JSON sidecar
``<file>.json``, or else uint16.

The metric functions are pure Python; generation is ``axonn_launch.generate.run_generation``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from axonn_launch.usage import help_page, run_tool, wants_help

DEFAULT_CONTINUATION = 50
DEFAULT_MAX_LENGTH = 2048
DEFAULT_CHUNK = 2048
DEFAULT_MAX_DOCUMENTS = 500  # the reference's num_samples
FORWARDED = ("grid.", "machine", "nodes", "name", "site.", "train.dtype", "stop_at_eos")
IDX_HEADER = b"MMIDIDX\x00\x00"
IDX_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}

Generator = Callable[..., list[dict]]


class MemorizationError(ValueError):
    """Bad input to the memorization tool: one line."""


# --------------------------------------------------------------------------- metrics


def exact_match(pred_ids: Sequence[int], truth_ids: Sequence[int]) -> bool:
    """All N tokens equal (and as many of them)."""
    return list(pred_ids) == list(truth_ids)


def token_match(pred: Sequence[int], truth: Sequence[int]) -> float:
    """Fraction of the truth's positions the prediction gets right (missing = wrong)."""
    if not truth:
        raise MemorizationError("token_match: the truth is empty")
    return sum(p == t for p, t in zip(pred, truth)) / len(truth)


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence (one-row dynamic programme)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(pred_tokens: Sequence[Any], truth_tokens: Sequence[Any]) -> float:
    """ROUGE-L F-measure: 2PR/(P+R) with P = LCS/|pred|, R = LCS/|truth| (rouge_score's)."""
    lcs = lcs_length(pred_tokens, truth_tokens)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred_tokens), lcs / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def rouge_words(text: str) -> list[str]:
    """rouge_score's default tokenizer: lowercase alphanumeric words."""
    return [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]


def split_document(ids: Sequence[int], continuation: int) -> tuple[list[int], list[int]] | None:
    """(prompt, truth): the last ``continuation`` tokens are the truth; None when the
    document has fewer than ``continuation + 1`` tokens (no prompt left)."""
    if len(ids) <= continuation:
        return None
    return list(ids[:-continuation]), list(ids[-continuation:])


def score(
    pred_ids: Sequence[int],
    truth_ids: Sequence[int],
    *,
    pred_text: str | None = None,
    truth_text: str | None = None,
) -> dict:
    """One document's metrics; ROUGE-L on words when both texts are given, else on ids."""
    on_words = pred_text is not None and truth_text is not None
    rouge = (
        rouge_l(rouge_words(pred_text), rouge_words(truth_text))
        if on_words
        else rouge_l(list(pred_ids), list(truth_ids))
    )
    return {
        "exact_match": exact_match(pred_ids, truth_ids),
        "token_match": token_match(pred_ids, truth_ids),
        "rouge_l": rouge,
    }


def summarize(results: Sequence[dict], skipped: int = 0) -> dict:
    """Means over the scored documents (rows of ``score``)."""
    n = len(results)

    def mean(key: str) -> float | None:
        return sum(float(r[key]) for r in results) / n if n else None

    return {
        "exact_match_rate": mean("exact_match"),
        "token_match": mean("token_match"),
        "rouge_l": mean("rouge_l"),
        "n_documents": n,
        "skipped": skipped,
    }


# ------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Our byte-level models (the built-in corpus): ids are UTF-8 bytes."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass
class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (the ``hf`` extra)."""

    path: Path
    _tok: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ModuleNotFoundError as exc:
            raise MemorizationError(
                f"{self.path} needs the tokenizers package: pip install -e '.[hf]'"
            ) from exc
        self._tok = _Tokenizer.from_file(str(self.path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(source: Path) -> Tokenizer | None:
    """The tokenizer of a model directory: ``tokenizer.json`` there, bytes for a job (or a
    checkpoint inside one) whose model has a vocabulary of at most 256, else None."""
    if (source / "tokenizer.json").is_file():
        return HFTokenizer(source / "tokenizer.json")
    for folder in [source, *source.parents][:4]:
        spec = folder / "spec.json"
        if spec.is_file():
            vocab = json.loads(spec.read_text()).get("model", {}).get("vocab_size", 0)
            return ByteTokenizer() if 0 < vocab <= 256 else None
    return None


# -------------------------------------------------------------------------- documents


def read_documents(
    path: Path, tokenizer: Tokenizer | None, *, chunk: int = DEFAULT_CHUNK
) -> Iterator[Sequence[int]]:
    """Token ids of each document in ``path`` (.jsonl, or .bin with or without .idx), read
    lazily: a .bin's documents are views of its memory map."""
    if not path.is_file():
        raise MemorizationError(f"data={path}: no such file")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, tokenizer)
    if path.suffix == ".bin":
        return _read_bin(path, chunk)
    raise MemorizationError(f"data={path}: expected a .jsonl or a .bin (with or without .idx)")


def _read_jsonl(path: Path, tokenizer: Tokenizer | None) -> Iterator[list[int]]:
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield _jsonl_document(_json_line(line, path, number), f"{path}:{number}", tokenizer)


def _json_line(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except ValueError as exc:
        raise MemorizationError(f"data={path}:{number}: not JSON ({exc})") from exc


def _jsonl_document(record: Any, where: str, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(record, dict) and isinstance(record.get("ids"), list):
        return [int(i) for i in record["ids"]]
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        if tokenizer is None:
            raise MemorizationError(
                f"data={where}: a text document needs a tokenizer; the model has none"
                ' (no tokenizer.json, not byte-level); give token ids as {"ids": [...]}'
            )
        return tokenizer.encode(record["text"])
    raise MemorizationError(f'data={where}: expected {{"ids": [...]}} or {{"text": "..."}}')


def _read_bin(path: Path, chunk: int) -> Iterator[Sequence[int]]:
    import numpy as np

    idx = path.with_suffix(".idx")
    if idx.is_file():
        dtype, sizes, pointers = _read_idx(idx)
        tokens = np.memmap(path, dtype=dtype, mode="r")
        starts = np.asarray(pointers) // np.dtype(dtype).itemsize
        return (tokens[s : s + n] for s, n in zip(starts, sizes))
    sidecar = path.with_name(path.name + ".json")
    dtype = json.loads(sidecar.read_text())["dtype"] if sidecar.is_file() else "uint16"
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return (tokens[s : s + chunk] for s in range(0, len(tokens), chunk))


def _read_idx(idx: Path) -> tuple[str, list[int], list[int]]:
    """(dtype, sizes, byte pointers) of a Megatron ``.idx`` (MMIDIDX, version 1)."""
    import numpy as np

    raw = idx.read_bytes()
    if not raw.startswith(IDX_HEADER) or len(raw) < 34:
        raise MemorizationError(f"data={idx}: not a Megatron index file")
    code = raw[17]
    if code not in IDX_DTYPES:
        raise MemorizationError(f"data={idx}: token dtype code {code}; valid: {sorted(IDX_DTYPES)}")
    count = int(np.frombuffer(raw, dtype="<u8", count=1, offset=18)[0])
    sizes = np.frombuffer(raw, dtype="<i4", count=count, offset=34)
    pointers = np.frombuffer(raw, dtype="<i8", count=count, offset=34 + 4 * count)
    return IDX_DTYPES[code], sizes.tolist(), pointers.tolist()


# ------------------------------------------------------------------------- evaluation


@dataclass
class Settings:
    source: str
    data: str
    out: str
    continuation: int = DEFAULT_CONTINUATION
    max_documents: int = DEFAULT_MAX_DOCUMENTS
    max_length: int = DEFAULT_MAX_LENGTH
    chunk: int = DEFAULT_CHUNK
    overrides: list[str] = field(default_factory=list)  # for the generation runner


def build_prompts(documents: Iterable[Sequence[int]], settings: Settings) -> tuple[list[dict], int]:
    """Prompts (``{"document", "ids", "truth"}``) of the first ``max_documents`` documents
    long enough, each cut to ``max_length`` tokens; and how many were skipped."""
    prompts, skipped = [], 0
    for number, ids in enumerate(documents):
        if len(prompts) == settings.max_documents:
            break
        split = split_document([int(i) for i in ids[: settings.max_length]], settings.continuation)
        if split is None:
            skipped += 1
            continue
        prompts.append({"document": number, "ids": split[0], "truth": split[1]})
    return prompts, skipped


def evaluate(
    prompts: Sequence[dict], outputs: Sequence[dict], tokenizer: Tokenizer | None, skipped: int
) -> dict:
    """The summary, ``rouge_on`` and one row per document."""
    if len(outputs) != len(prompts):
        raise MemorizationError(
            f"the generator returned {len(outputs)} outputs for {len(prompts)} prompts"
        )
    rows = [_row(p, o, tokenizer) for p, o in zip(prompts, outputs)]
    summary = summarize(rows, skipped)
    return {**summary, "rouge_on": "words" if tokenizer else "token ids", "documents": rows}


def _row(prompt: dict, output: dict, tokenizer: Tokenizer | None) -> dict:
    pred, truth = [int(i) for i in output["output_ids"]], prompt["truth"]
    texts = (tokenizer.decode(pred), tokenizer.decode(truth)) if tokenizer else (None, None)
    row = {"document": prompt["document"], "prompt_tokens": len(prompt["ids"])}
    row |= score(pred, truth, pred_text=texts[0], truth_text=texts[1])
    row |= {"truth_ids": truth, "output_ids": pred}
    if tokenizer:
        row |= {"truth_text": texts[1], "output_text": texts[0]}
    return row


def run(settings: Settings, generate: Generator | None = None) -> dict:
    """Read, prompt, generate, score; writes ``settings.out`` and returns its content."""
    source = Path(settings.source)
    if not source.is_dir():
        raise MemorizationError(f"source {source}: not a directory (a checkpoint, job or HF dir)")
    tokenizer = load_tokenizer(source)
    documents = read_documents(Path(settings.data), tokenizer, chunk=settings.chunk)
    prompts, skipped = build_prompts(documents, settings)
    generate = generate or _generation_runner()
    outputs = (
        generate(
            str(source),
            [{"ids": p["ids"]} for p in prompts],
            max_new_tokens=settings.continuation,
            overrides=list(settings.overrides),
            temperature=0.0,
            top_k=0,
        )
        if prompts
        else []
    )
    result = {"source": str(source), "data": settings.data, "continuation": settings.continuation}
    result |= evaluate(prompts, outputs, tokenizer, skipped)
    _write_json(Path(settings.out), result)
    return result


def _generation_runner() -> Generator:
    try:
        from axonn_launch.generate import run_generation
    except ModuleNotFoundError as exc:
        if exc.name != "axonn_launch.generate":
            raise
        raise MemorizationError(
            "this installation has no generation runner (axonn_launch.generate)"
        ) from exc
    return run_generation


def _write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1))
    tmp.replace(path)


def format_table(result: dict, rows: int = 10) -> str:
    """The summary line and the first ``rows`` documents."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'document':>8}  {'prompt':>6}  {'exact':>5}  {'token':>6}  {'ROUGE-L':>7}"]
    for r in result["documents"][:rows]:
        lines.append(
            f"{r['document']:>8}  {r['prompt_tokens']:>6}  {str(r['exact_match']):>5}"
            f"  {r['token_match']:>6.3f}  {r['rouge_l']:>7.3f}"
        )
    if len(result["documents"]) > rows:
        lines.append(f"{'...':>8}")
    lines.append(
        f"{result['n_documents']} documents ({result['skipped']} skipped, too short):"
        f" exact match {num(result['exact_match_rate'])}, token match"
        f" {num(result['token_match'])}, ROUGE-L {num(result['rouge_l'])}"
        f" (on {result['rouge_on']})"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the CLI

HELP = help_page(
    usage="python -m axonn_launch.memorization SOURCE data=FILE out=FILE [KEY=VALUE ...]",
    summary=(
        "Greedy continuations of training documents scored against the truth (exact match,"
        '\ntoken match, ROUGE-L), the memorization measure of Hans et al. 2024, "Be like a'
        '\nGoldfish" (arXiv 2406.10209), as in arXiv 2502.08145. SOURCE: a checkpoint, job or'
        "\nHugging Face dir."
    ),
    keys=[
        ("data=FILE", '.jsonl of {"ids": [...]} or {"text": ...}, or a token .bin (+ .idx)'),
        ("out=FILE", "the JSON written: summary and one row per document"),
        ("continuation=N", f"tokens generated and compared (default {DEFAULT_CONTINUATION})"),
        ("max_documents=N", f"documents scored (default {DEFAULT_MAX_DOCUMENTS})"),
        (
            "max_length=N",
            f"each document is cut to its first N tokens (default {DEFAULT_MAX_LENGTH})",
        ),
        ("chunk=N", f"a .bin without .idx: documents of N tokens (default {DEFAULT_CHUNK})"),
        ("batch_size=N", "prompts per generation batch (passed to the generation runner)"),
        ("grid.*=N machine=NAME", "where the model runs (passed to the generation runner)"),
        ("nodes= name= site.*=", "more launcher keys for the generation job (passed on)"),
        ("--debug", "a traceback instead of a one-line error"),
    ],
    examples=[
        "python -m axonn_launch.memorization jobs/gpt_tiny-local/2026-12-01_10-00-00"
        " data=docs.jsonl continuation=50 out=memorization.json",
    ],
)

INT_KEYS = ("continuation", "max_documents", "max_length", "chunk")


def parse_args(argv: Sequence[str]) -> Settings:
    sources = [a for a in argv if "=" not in a]
    if len(sources) != 1:
        raise MemorizationError(f"expected one SOURCE directory, got {sources or 'none'}")
    values: dict[str, Any] = {"source": sources[0], "overrides": []}
    for arg in (a for a in argv if "=" in a):
        key, value = arg.split("=", 1)
        if key in INT_KEYS:
            values[key] = _positive_int(key, value)
        elif key in ("data", "out"):
            values[key] = value
        elif key == "batch_size":
            values["overrides"].append(f"batch_size={_positive_int(key, value)}")
        elif key.startswith(FORWARDED):
            values["overrides"].append(arg)
        else:
            valid = ", ".join(("data", "out", *INT_KEYS, "batch_size", "grid.*", "machine"))
            raise MemorizationError(f"{key}={value}: unknown key; valid: {valid}")
    for key in ("data", "out"):
        if key not in values:
            raise MemorizationError(f"{key}= is required")
    return Settings(**values)


def _positive_int(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise MemorizationError(f"{key}={value}: expected a positive integer")
    return int(value)


def main(argv: list[str] | None = None, generate: Generator | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0

    def _main(args: list[str]) -> int:
        print(format_table(run(parse_args(args), generate)))
        return 0

    return run_tool(_main, argv, (MemorizationError, json.JSONDecodeError))


if __name__ == "__main__":
    sys.exit(main())
