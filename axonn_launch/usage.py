"""What the command-line tools share: ``--help`` pages, one-line errors, ``--debug``.

A user's mistake (a bad key, a missing file, no allocation) ends with one line on
stderr and exit code 2; ``--debug`` or ``HYDRA_FULL_ERROR=1`` shows the traceback
instead. Login-node code: never imports torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

EXIT_BAD_INPUT = 2
HELP_FLAGS = ("--help", "-h")
DEBUG_FLAG = "--debug"

# The tools of ``python -m axonn_launch.<tool>``, in the order the launcher's --help lists
# them; a tool is listed only when its module exists in this installation.
TOOLS: dict[str, str] = {
    "plan": "the fastest 4D grids for a machine, model and node count (predicted)",
    "calibrate": "measure collective bandwidths and GEMM speed for the planner",
    "jobs": "status of launched jobs; resubmit the failed ones worth resubmitting",
    "export": "write a checkpoint's full tensors (.pt, safetensors) or a Hugging Face model",
    "generate": "continue prompts with a job's checkpoint or a Hugging Face model, on any grid",
    "data": "tokenize text into indexed datasets; pack fine-tuning data with a loss mask",
    "memorization": "score greedy continuations of training documents against the truth",
    "report": "plots and a report.md for a job, a sweep or a memorization study",
    "study": "data for the memorization study: a corpus with canaries repeated R times",
}


def debugging(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def help_page(
    *, usage: str, summary: str, keys: Sequence[tuple[str, str]], examples: Sequence[str]
) -> str:
    """A --help page: usage, what it does, one line per key, examples."""
    width = max(len(key) for key, _ in keys)
    return "\n".join(
        [
            f"usage: {usage}",
            "",
            summary,
            "",
            "keys:",
            *(f"  {key.ljust(width)}  {text}" for key, text in keys),
            "",
            "examples:",
            *(f"  {example}" for example in examples),
        ]
    )


def run_tool(
    main: Callable[[list[str]], int],
    argv: list[str],
    user_errors: tuple[type[BaseException], ...],
) -> int:
    """``main(argv)`` with ``user_errors`` as one line and exit code 2 (unless debugging)."""
    debug = debugging(argv)
    try:
        return main([a for a in argv if a != DEBUG_FLAG])
    except user_errors as exc:
        if debug:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `... | head` stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def raising_parser(error: type[Exception], suffix: str = "") -> type[argparse.ArgumentParser]:
    """An ``ArgumentParser`` class whose errors raise ``error`` (one line, exit code 2
    through ``run_tool``) instead of printing the usage and exiting; sub-parsers too."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:
            raise error(f"{message}{suffix}")

    return Parser


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


def available_tools() -> list[tuple[str, str]]:
    """(module, one-line description) of each tool installed here."""
    tools = []
    for name, text in TOOLS.items():
        spec = importlib.util.find_spec(f"axonn_launch.{name}")
        if spec is None or spec.origin is None:
            continue
        tools.append((name, text or _docstring_line(spec.origin)))
    return tools


def _docstring_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            doc = ast.get_docstring(ast.parse(handle.read())) or ""
    except (OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def tools_section() -> str:
    """The launcher's --help lines naming the other commands (a Hydra help resolver)."""
    tools = available_tools()
    width = max(len(f"python -m axonn_launch.{name}") for name, _ in tools)
    lines = [f"  {f'python -m axonn_launch.{n}'.ljust(width)}  {t}" for n, t in tools]
    return "\n".join([*lines, "  (each takes --help)"])


def register_help_resolver() -> None:
    """Let conf/config.yaml's hydra.help.template name the tools installed here."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("axonn_tools"):
        OmegaConf.register_new_resolver("axonn_tools", tools_section)
