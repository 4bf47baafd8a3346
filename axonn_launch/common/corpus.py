"""Text into token ids: a tokenizer (``tokenizer.json`` or a Hugging Face directory), the
documents of ``.txt``/``.jsonl`` files, fine-tuning conversations with their loss mask, and
their packing into fixed-length sequences. The data command drives it; ``IndexedWriter``
(``common/indexed.py``) writes the result. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ASSISTANT = "assistant"


class DataError(ValueError):
    """A user's mistake: one line, exit code 2."""


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
