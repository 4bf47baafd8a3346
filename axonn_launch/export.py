"""Write a checkpoint's full tensors to a torch state dict (.pt) or safetensors.

The command: ``--to`` a ``.pt``/``.safetensors`` file, ``--hf`` a Hugging Face directory,
``--convert-legacy`` for a checkpoint of the previous format
(``python -m axonn_launch.export --help`` shows how). Checks here are torch-free; torch is
imported only to do the work (``train/checkpoint/export.py``).

More on the formats: ``docs/checkpoints.md`` ("export.py").
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from axonn_launch.common.formats import LEGACY_FORMAT
from axonn_launch.common.jobdir import CheckpointMissing, read_step_meta, resolve_checkpoint
from axonn_launch.usage import help_page, run_tool, wants_help

SUFFIXES = (".pt", ".safetensors")
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip

HELP = help_page(
    usage=(
        "python -m axonn_launch.export CHECKPOINT --to OUT | CHECKPOINT --hf DIR "
        "[--dtype bf16|fp32] [--max-shard-size 5GB] | --convert-legacy CHECKPOINT"
    ),
    summary=(
        "Write every tensor of a checkpoint (parameters, AdamW moments) in full, one at a\n"
        "time, as a torch state dict or safetensors; or a Llama checkpoint's weights as a\n"
        "Hugging Face model directory; or convert a per-rank-shards/1 checkpoint to the\n"
        "current DCP format in place."
    ),
    keys=[
        ("CHECKPOINT", "a checkpoints/step_N directory, or a job directory (its latest)"),
        ("--to OUT", "OUT.pt: torch.save format; OUT.safetensors or a directory: safetensors"),
        ("--hf DIR", "a new (or empty) directory: Hugging Face Llama (config, shards, tokenizer)"),
        ("--dtype", "with --hf: fp32 (default) or bf16"),
        ("--max-shard-size", "with --hf: largest safetensors file, e.g. 5GB (default), 500MB"),
        ("--convert-legacy", "convert CHECKPOINT (per-rank-shards/1) to DCP in place"),
        ("--debug", "show the traceback of an error"),
    ],
    examples=[
        "python -m axonn_launch.export jobs/gpt_tiny-local/2026-12-01_08-00-00 --to tiny.pt",
        "python -m axonn_launch.export jobs/x/checkpoints/step_00000120 --to tensors_dir/",
        "python -m axonn_launch.export jobs/llama/2026-12-01_08-00-00 --hf llama_hf/ --dtype bf16",
        "python -m axonn_launch.export --convert-legacy jobs/x/checkpoints/step_00000060",
    ],
)


class ExportError(ValueError):
    """A user's mistake: one line, exit code 2."""


def checkpoint_format(path: Path) -> str:
    return read_step_meta(path).get("format", "")


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


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9 bytes (``GiB``: powers of 2; a plain number: bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise ExportError(
            f"--max-shard-size={text!r}: expected a positive size such as 5GB, 500MB, 2GiB "
            "or a number of bytes"
        )
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def _take(args: list[str], flag: str, what: str) -> str | None:
    """Remove ``flag VALUE`` from ``args``; the value or None when absent."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args) or args[i + 1].startswith("--"):
        raise ExportError(f"{flag} needs a value: {what}")
    value = args[i + 1]
    del args[i : i + 2]
    if flag in args:
        raise ExportError(f"{flag} given twice")
    return value


def hf_output(text: str) -> Path:
    out = Path(text)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--hf={text!r}: exists and is not an empty directory; name a new one")
    if not out.parent.is_dir():
        raise ExportError(f"--hf={text!r}: directory {str(out.parent)!r} does not exist")
    return out


def hf_model_problem(checkpoint: Path) -> str | None:
    """Why the checkpoint cannot be written as a Hugging Face Llama (torch-free)."""
    meta = read_step_meta(checkpoint)
    model = meta.get("model")
    if not isinstance(model, dict):
        return f"checkpoint={str(checkpoint)!r}: meta.json names no model; --hf needs one"
    arch = model.get("arch", "gpt")
    if arch != "llama":
        return (
            f"checkpoint={str(checkpoint)!r} holds model.arch={arch!r}: Hugging Face export "
            "(--hf) is for Llama models; --to writes any checkpoint's tensors"
        )
    return None


def parse(argv: list[str]) -> tuple[str, Path, Path | None, dict]:
    """(action, checkpoint, output, options) from the command line."""
    args = list(argv)
    if "--convert-legacy" in args:
        args.remove("--convert-legacy")
        if len(args) != 1:
            raise ExportError("--convert-legacy takes one CHECKPOINT (see --help)")
        return "convert", resolve_checkpoint(args[0]), None, {}
    to = _take(args, "--to", "a .pt or .safetensors file, or a directory")
    hf = _take(args, "--hf", "a new directory for the Hugging Face model")
    dtype = _take(args, "--dtype", "bf16 or fp32")
    size = _take(args, "--max-shard-size", "a size such as 5GB")
    if to is not None and hf is not None:
        raise ExportError("--to and --hf: give one of them (see --help)")
    if to is None and hf is None:
        raise ExportError(
            "--to OUT (a .pt or .safetensors file, or a directory) or --hf DIR is required"
        )
    if hf is None and (dtype is not None or size is not None):
        raise ExportError("--dtype and --max-shard-size go with --hf (see --help)")
    if len(args) != 1 or args[0].startswith("-"):
        raise ExportError(f"expected one CHECKPOINT, got {args!r} (see --help)")
    checkpoint = resolve_checkpoint(args[0])
    if to is not None:
        return "export", checkpoint, output_path(to), {}
    if dtype is not None and dtype not in HF_DTYPES:
        raise ExportError(f"--dtype={dtype!r}: expected one of {', '.join(HF_DTYPES)}")
    options = {
        "dtype": dtype or "fp32",
        "max_shard_bytes": parse_size(size) if size is not None else 5 * 10**9,
    }
    problem = hf_model_problem(checkpoint)
    if problem:
        raise ExportError(problem)
    return "hf", checkpoint, hf_output(hf), options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    return run_tool(_main, argv, (ExportError, CheckpointMissing))


def _main(argv: list[str]) -> int:
    action, checkpoint, out, options = parse(argv)
    fmt = checkpoint_format(checkpoint)
    if action == "convert":
        if fmt != LEGACY_FORMAT:
            raise ExportError(f"checkpoint={str(checkpoint)!r} has format {fmt!r}, not legacy")
        from axonn_launch.train.checkpoint.export import convert_legacy

        kept = convert_legacy(checkpoint)
        print(f"converted {checkpoint} to DCP; the old files are in {kept}")
        return 0
    if fmt == LEGACY_FORMAT:
        raise ExportError(
            f"checkpoint={str(checkpoint)!r} has the legacy format {fmt}; convert it first "
            "with --convert-legacy"
        )
    if action == "hf":
        import torch

        from axonn_launch.train.checkpoint.export import export_hf

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[options["dtype"]]
        tensors, files, copied = export_hf(
            checkpoint, out, dtype=dtype, max_shard_bytes=options["max_shard_bytes"]
        )
        extra = f", tokenizer files {', '.join(copied)}" if copied else ", no tokenizer files"
        print(f"wrote {tensors} tensors of {checkpoint} to {out} ({files} file(s){extra})")
        return 0
    from axonn_launch.train.checkpoint.export import export_checkpoint

    count = export_checkpoint(checkpoint, out)
    print(f"wrote {count} tensors of {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
