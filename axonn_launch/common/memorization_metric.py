"""The memorization metric of the Goldfish study, shared by the in-job evaluation
(``train/inference/memorize_job.py``) and the ``python -m axonn_launch.memorization`` tool, which
describes the measurement. Documents are read, cut into prompt and truth, and the model's
greedy continuations scored: exact match, token match and ROUGE-L. Pure Python and numpy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from axonn_launch.common.indexed import read_index
from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.tokenfile import bin_dtype

DEFAULT_CONTINUATION = 50
DEFAULT_MAX_LENGTH = 2048
DEFAULT_CHUNK = 2048
DEFAULT_MAX_DOCUMENTS = 500  # the reference's num_samples


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
        spec = JobPaths(folder).spec
        if spec.is_file():
            vocab = json.loads(spec.read_text()).get("model", {}).get("vocab_size", 0)
            return ByteTokenizer() if 0 < vocab <= 256 else None
    return None


# -------------------------------------------------------------------------- documents


def read_documents(
    path: Path,
    tokenizer: Tokenizer | None,
    *,
    chunk: int = DEFAULT_CHUNK,
    model_vocab: int | None = None,
) -> Iterator[Sequence[int]]:
    """Token ids of each document in ``path`` (.jsonl, or .bin with or without .idx), read
    lazily: a .bin's documents are views of its memory map, read as the job reads them
    (``tokenfile.bin_dtype``; ``model_vocab`` decides the dtype when nothing beside it does)."""
    if not path.is_file():
        raise MemorizationError(f"data={path}: no such file")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, tokenizer)
    if path.suffix == ".bin":
        return _read_bin(path, chunk, model_vocab)
    raise MemorizationError(f"data={path}: expected a .jsonl or a .bin (with or without .idx)")


def model_vocab(source: Path) -> int | None:
    """The vocabulary size of the model in ``source``: a job's (or a checkpoint's inside one)
    ``spec.json``, else a Hugging Face ``config.json``; None when neither says."""
    for folder in [source, *source.parents][:4]:
        spec = JobPaths(folder).spec
        if spec.is_file():
            return json.loads(spec.read_text()).get("model", {}).get("vocab_size")
    config = source / "config.json"
    return json.loads(config.read_text()).get("vocab_size") if config.is_file() else None


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


def _read_bin(path: Path, chunk: int, vocab: int | None) -> Iterator[Sequence[int]]:
    import numpy as np

    try:
        dtype = bin_dtype(path, vocab)
        index = read_index(path.with_suffix(".idx")) if path.with_suffix(".idx").is_file() else None
    except ValueError as exc:
        raise MemorizationError(f"data={exc}") from exc
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if index is not None:
        return (tokens[s : s + n] for s, n in zip(index.sequence_starts(), index.sizes))
    return (tokens[s : s + chunk] for s in range(0, len(tokens), chunk))


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


def write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1))
    tmp.replace(path)
