"""Data for the memorization study: a corpus with canaries repeated R times.

The study is the paper's memorization experiment (arXiv 2502.08145, with the Goldfish loss
of Hans et al. 2024, "Be like a Goldfish", arXiv 2406.10209); its sweep is
``conf/study/memorization.yaml``. ``prepare(DIR, ...)`` writes the files, byte-level; the
Hydra callback ``PrepareStudy`` runs it at the start of a sweep. Login-node code: no torch.

The files, the canaries and why they are built so: ``docs/data.md``
("submit/study_data.py").
"""

from __future__ import annotations

import json
import string
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from axonn_launch.common.indexed import IndexedWriter

CORPUS = Path(__file__).parents[1] / "train" / "assets" / "tinyshakespeare.txt"
TRAIN_FRACTION = 0.9  # the loader's (train/data.py TRAIN_FRACTION)
VOCAB = 256
DTYPE = np.dtype(np.uint8)
DEFAULTS = {
    "canaries": 32,
    "canary_len": 160,
    "repetitions": (1, 8, 32),
    "seed": 0,
    "corpus_bytes": 0,  # 0: the whole train split
}


class StudyError(ValueError):
    """Bad input to the study tool: one line."""


# ------------------------------------------------------------------------- the text


def corpus_splits(corpus_bytes: int = 0) -> tuple[bytes, bytes]:
    """(train, val) of the built-in corpus as the loader splits it: the first 90% of the
    bytes, the rest. ``corpus_bytes`` > 0 keeps only that much of train, cut after a
    paragraph."""
    text = CORPUS.read_bytes()
    cut = int(len(text) * TRAIN_FRACTION)
    train, val = text[:cut], text[cut:]
    if 0 < corpus_bytes < len(train):
        end = train.rfind(b"\n\n", 0, corpus_bytes)
        train = train[: end + 2 if end > 0 else corpus_bytes]
    return train, val


def paragraphs(text: bytes) -> list[bytes]:
    """Documents: each paragraph with the blank line after it (their concatenation is
    ``text``)."""
    parts = text.split(b"\n\n")
    docs = [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    return [d for d in docs if d]


def make_canary(rng: np.random.Generator, length: int) -> bytes:
    """``length`` bytes of random 3-8-letter lowercase words separated by spaces."""
    letters = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
    out = bytearray()
    while len(out) < length:
        word = letters[rng.integers(0, len(letters), size=int(rng.integers(3, 9)))]
        out += word.tobytes() + b" "
    return bytes(out[:length])


def make_canaries(count: int, length: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng([seed, 0xCA7A])
    return [make_canary(rng, length) for _ in range(count)]


def with_canaries(
    docs: Sequence[bytes], canaries: Sequence[bytes], repetitions: int, seed: int
) -> list[bytes]:
    """``docs`` in order with ``repetitions`` copies of every canary, each copy between
    two documents at a uniformly random place."""
    rng = np.random.default_rng([seed, repetitions])
    copies = [c for c in range(len(canaries)) for _ in range(repetitions)]
    slots = rng.integers(0, len(docs) + 1, size=len(copies))
    order = rng.permutation(len(copies))  # canaries in one slot in random order
    inserts: dict[int, list[int]] = {}
    for i in order:
        inserts.setdefault(int(slots[i]), []).append(copies[i])
    out: list[bytes] = []
    for slot in range(len(docs) + 1):
        out += [canaries[c] for c in inserts.get(slot, [])]
        if slot < len(docs):
            out.append(docs[slot])
    return out


def tail_length(train_tokens: int) -> int:
    """Tokens to append so that the loader's train split is exactly the first
    ``train_tokens``: ``int((train + tail) * 0.9) == train``."""
    tail = -(-train_tokens // 9)
    while int((train_tokens + tail) * TRAIN_FRACTION) > train_tokens:
        tail -= 1
    while int((train_tokens + tail) * TRAIN_FRACTION) < train_tokens:
        tail += 1
    if int((train_tokens + tail) * TRAIN_FRACTION) != train_tokens:
        raise StudyError(f"no tail puts the 90% cut after {train_tokens} tokens")
    return tail


def cycled(text: bytes, length: int) -> bytes:
    return (text * (length // max(len(text), 1) + 1))[:length]


# ------------------------------------------------------------------------- writing


def write_documents(prefix: Path, docs: Sequence[bytes], meta: dict) -> dict:
    writer = IndexedWriter(prefix, DTYPE)
    try:
        tokens = np.frombuffer(b"".join(docs), dtype=np.uint8)
        writer.add(tokens, [len(d) for d in docs])
        return writer.commit({"vocab_size": VOCAB, **meta})
    except BaseException:
        writer.abort()
        raise


def cli_flag(key: str) -> str:
    return f"--{key.replace('_', '-')}"


def settings_of(name: Callable[[str], str] = cli_flag, **given: Any) -> dict:
    """The settings with defaults filled in; a bad one raises, named by ``name(key)``."""
    settings = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    for key, low in (("canaries", 1), ("canary_len", 1), ("corpus_bytes", 0), ("seed", 0)):
        if not _is_int(settings[key]) or settings[key] < low:
            raise StudyError(f"{name(key)}={settings[key]!r}: expected an integer >= {low}")
    counts = list(settings["repetitions"])
    if not counts or not all(_is_int(r) and r >= 0 for r in counts):
        raise StudyError(f"{name('repetitions')}={counts}: expected counts >= 0")
    settings["repetitions"] = sorted(set(counts))
    return settings


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prepare(out: Path, **given: Any) -> dict:
    """Write the study's data into ``out``; returns ``study.json``'s content."""
    settings = settings_of(**given)
    out.mkdir(parents=True, exist_ok=True)
    train, val = corpus_splits(int(settings["corpus_bytes"]))
    docs = paragraphs(train)
    canaries = make_canaries(settings["canaries"], settings["canary_len"], settings["seed"])
    if any(c in train or c in val for c in canaries):  # astronomically unlikely
        raise StudyError("a canary occurs in the corpus; pick another --seed")
    with (out / "canaries.jsonl").open("w") as f:
        for i, c in enumerate(canaries):
            f.write(json.dumps({"canary": i, "ids": list(c), "text": c.decode()}) + "\n")
    write_documents(out / "val", paragraphs(val), {"split": "val of the built-in corpus"})
    files = {}
    for r in settings["repetitions"]:
        mixed = with_canaries(docs, canaries, r, settings["seed"])
        trained = sum(len(d) for d in mixed)
        tail = cycled(val, tail_length(trained))
        meta = write_documents(out / f"r{r}", [*mixed, tail], {"repetitions": r})
        files[f"r{r}"] = {
            "repetitions": r,
            "train_tokens": trained,
            "tail_tokens": len(tail),
            "documents": meta["documents"],
            "canary_share": r * sum(len(c) for c in canaries) / trained,
        }
    study = {**settings, "corpus": CORPUS.name, "files": files, "val_tokens": len(val)}
    (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    return study


def prepared(out: Path, **given: Any) -> bool:
    """``out`` already holds the data of these settings."""
    path = out / "study.json"
    if not path.is_file():
        return False
    settings = settings_of(**given)
    have = json.loads(path.read_text())
    return all(have.get(k) == v for k, v in settings.items()) and all(
        (out / f"r{r}.bin").is_file() for r in settings["repetitions"]
    )


# --------------------------------------------------------------- the Hydra callback

try:  # the launcher's environment has Hydra; the study command does not need it
    from hydra.experimental.callback import Callback as _Callback
except ModuleNotFoundError:  # pragma: no cover
    _Callback = object  # type: ignore[assignment,misc]


class PrepareStudy(_Callback):  # type: ignore[misc,valid-type]
    """Prepares the study's data at the start of a run or sweep unless already there.

    ``study`` is the study config's ``study:`` section (``dir``, ``all_repetitions``,
    ``canaries``, ``canary_len``, ``corpus_bytes``, ``seed``); the launcher's argument
    check (``cli.check_arguments``) calls ``ensure`` itself before a single run checks that
    ``train.data`` exists."""

    KEYS = {"repetitions": "all_repetitions"}  # setting -> its key under study: when not equal

    def __init__(self, study: Mapping[str, Any]) -> None:
        self.out = Path(study["dir"])
        self.settings = {key: study[self.KEYS.get(key, key)] for key in DEFAULTS}
        self.settings["repetitions"] = list(self.settings["repetitions"])
        settings_of(lambda key: f"study.{self.KEYS.get(key, key)}", **self.settings)

    def ensure(self) -> None:
        if not prepared(self.out, **self.settings):
            print(f"study: preparing the data in {self.out}", file=sys.stderr)
            prepare(self.out, **self.settings)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.ensure()

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self.ensure()
