"""What a sample's tokens read as: text for the built-in byte-level corpus, ids otherwise.

The end-of-run sample itself is ``generation.generate_one``: a model trained on the
built-in byte corpus has no end-of-sequence id, so its sample always runs the tokens
asked for.
"""

from __future__ import annotations


def decode(tokens: list[int], data: str) -> str:
    """Text for the built-in byte-level corpus; token ids otherwise.

    Bytes a young model strings together are often not UTF-8, or are terminal control
    codes: both are shown escaped (``\\xe2``), so a log or a terminal shows only what the
    model wrote. A model whose vocabulary is larger than the bytes (``llama_tiny``: 512)
    may pick an id with no text: it shows as ``<id:300>``.
    """
    if data != "shakespeare":
        return " ".join(str(t) for t in tokens)
    text = byte_text(tokens, errors="backslashreplace")
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def byte_text(ids: list[int], errors: str = "replace") -> str:
    """``ids`` as UTF-8 bytes, each id outside 0..255 as ``<id:N>`` (a token of no text)."""
    parts, run = [], bytearray()
    for token in ids:
        if 0 <= token < 256:
            run.append(token)
            continue
        parts += [run.decode("utf-8", errors), f"<id:{token}>"]
        run = bytearray()
    return "".join([*parts, run.decode("utf-8", errors)])


def default_prompt(data: str) -> list[int]:
    return list(b"\n") if data == "shakespeare" else [0]
