"""Write a checkpoint's full tensors to a torch state dict (.pt) or safetensors.

    python -m axonn_launch.export <checkpoint> --to <file.pt | file.safetensors | dir>
    python -m axonn_launch.export --convert-legacy <checkpoint>

``<checkpoint>`` is a ``step_N`` directory or a job directory (its ``latest``). Tensors
are read and written one at a time, so memory holds one full tensor. The checkpoints
are plain torch.distributed.checkpoint directories: stock tools read them too
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).
``--convert-legacy`` rewrites a checkpoint of the previous per-rank format in place
(keeping the old one as ``<name>.legacy``); jobs also resume from such checkpoints
directly. Checks here are torch-free; torch is imported only to do the work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from axonn_launch.usage import help_page, run_tool, wants_help

LEGACY_FORMAT = "per-rank-shards/1"
SUFFIXES = (".pt", ".safetensors")

HELP = help_page(
    usage="python -m axonn_launch.export CHECKPOINT --to OUT | --convert-legacy CHECKPOINT",
    summary=(
        "Write every tensor of a checkpoint (parameters, AdamW moments) in full, one at a\n"
        "time, as a torch state dict or safetensors; or convert a per-rank-shards/1\n"
        "checkpoint to the current DCP format in place."
    ),
    keys=[
        ("CHECKPOINT", "a checkpoints/step_N directory, or a job directory (its latest)"),
        ("--to OUT", "OUT.pt: torch.save format; OUT.safetensors or a directory: safetensors"),
        ("--convert-legacy", "convert CHECKPOINT (per-rank-shards/1) to DCP in place"),
        ("--debug", "show the traceback of an error"),
    ],
    examples=[
        "python -m axonn_launch.export jobs/gpt_tiny-local/2026-12-01_08-00-00 --to tiny.pt",
        "python -m axonn_launch.export jobs/x/checkpoints/step_00000120 --to hf_dir/",
        "python -m axonn_launch.export --convert-legacy jobs/x/checkpoints/step_00000060",
    ],
)


class ExportError(ValueError):
    """A user's mistake: one line, exit code 2."""


def resolve_checkpoint(text: str) -> Path:
    """The step directory named by ``text`` (itself, or a job directory's latest)."""
    path = Path(text)
    pointer = path / "checkpoints" / "latest"
    if pointer.is_file():
        path = path / "checkpoints" / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise ExportError(
            f"checkpoint={text!r}: no complete checkpoint there (no meta.json); expected a "
            "checkpoints/step_N directory or a job directory with checkpoints/latest"
        )
    return path


def checkpoint_format(path: Path) -> str:
    return json.loads((path / "meta.json").read_text()).get("format", "")


def output_path(text: str) -> Path:
    out = Path(text)
    is_file = out.suffix in SUFFIXES
    if out.suffix and not is_file and not out.is_dir():
        raise ExportError(f"--to={text!r}: use a .pt or .safetensors file, or a directory")
    parent = out.parent if is_file else out
    if is_file and not parent.is_dir():
        raise ExportError(f"--to={text!r}: directory {str(parent)!r} does not exist")
    if out.exists() and out.is_dir() == is_file:
        raise ExportError(f"--to={text!r}: exists and is not a {'file' if is_file else 'dir'}")
    return out


def parse(argv: list[str]) -> tuple[str, Path, Path | None]:
    """(action, checkpoint, output) from the command line."""
    args = list(argv)
    if "--convert-legacy" in args:
        args.remove("--convert-legacy")
        if len(args) != 1:
            raise ExportError("--convert-legacy takes one CHECKPOINT (see --help)")
        return "convert", resolve_checkpoint(args[0]), None
    if "--to" not in args or args.index("--to") + 1 >= len(args):
        raise ExportError("--to OUT is required: a .pt or .safetensors file, or a directory")
    i = args.index("--to")
    out = args[i + 1]
    rest = args[:i] + args[i + 2 :]
    if len(rest) != 1 or rest[0].startswith("-"):
        raise ExportError(f"expected one CHECKPOINT, got {rest!r} (see --help)")
    return "export", resolve_checkpoint(rest[0]), output_path(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    return run_tool(_main, argv, (ExportError,))


def _main(argv: list[str]) -> int:
    action, checkpoint, out = parse(argv)
    fmt = checkpoint_format(checkpoint)
    if action == "convert":
        if fmt != LEGACY_FORMAT:
            raise ExportError(f"checkpoint={str(checkpoint)!r} has format {fmt!r}, not legacy")
        from axonn_launch.train.export import convert_legacy

        kept = convert_legacy(checkpoint)
        print(f"converted {checkpoint} to DCP; the old files are in {kept}")
        return 0
    if fmt == LEGACY_FORMAT:
        raise ExportError(
            f"checkpoint={str(checkpoint)!r} has the legacy format {fmt}; convert it first "
            "with --convert-legacy"
        )
    from axonn_launch.train.export import export_checkpoint

    count = export_checkpoint(checkpoint, out)
    print(f"wrote {count} tensors of {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
