"""``python -m axonn_launch.study prepare --out DIR [--canaries N] [--canary-len L]
[--repetitions 1,8,32] [--seed S] [--corpus-bytes B]``: the memorization study's data, a
corpus with canaries repeated R times (arXiv 2502.08145; the sweep is
``conf/study/memorization.yaml``, whose Hydra callback prepares the same data by itself).
What it writes, and how: ``submit/study_data.py``. No torch here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from axonn_launch.submit.study_data import DEFAULTS, StudyError, prepare
from axonn_launch.usage import help_page, raising_parser, wants_help

# ----------------------------------------------------------------------------- CLI


_Parser = raising_parser(StudyError, " (python -m axonn_launch.study --help)")

HELP = help_page(
    usage="python -m axonn_launch.study prepare --out DIR [--canaries N] [--canary-len L]"
    " [--repetitions 1,8,32] [--seed S] [--corpus-bytes B]",
    summary=(
        "Data for the memorization study (arXiv 2502.08145; the Goldfish loss of Hans et al.\n"
        '2024, "Be like a Goldfish", arXiv 2406.10209): the built-in corpus with canaries\n'
        "repeated R times, one r<R>.bin per R, plus val.bin, canaries.jsonl and study.json.\n"
        "python -m axonn_launch -m +study=memorization prepares it by itself."
    ),
    keys=[
        ("prepare", "the command"),
        ("--out DIR", "output directory"),
        ("--canaries N", f"canaries (default {DEFAULTS['canaries']})"),
        ("--canary-len L", f"bytes per canary (default {DEFAULTS['canary_len']})"),
        ("--repetitions R,...", "copies of each canary, one file each (default 1,8,32)"),
        ("--seed S", "canaries and their places (default 0)"),
        ("--corpus-bytes B", "use only the first B bytes of the train split (0: all)"),
    ],
    examples=[
        "python -m axonn_launch.study prepare --out data/study --canaries 32 --canary-len 160"
        " --repetitions 1,8,32",
    ],
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m axonn_launch.study", add_help=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", add_help=False)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--canaries", type=int, help=f"canaries (default {DEFAULTS['canaries']})")
    p.add_argument(
        "--canary-len", type=int, help=f"bytes per canary (default {DEFAULTS['canary_len']})"
    )
    p.add_argument(
        "--repetitions",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="comma-separated copies of each canary, one file each (default 1,8,32)",
    )
    p.add_argument("--seed", type=int, help="canaries and their places (default 0)")
    p.add_argument(
        "--corpus-bytes", type=int, help="use only the first B bytes of the train split (0: all)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    try:
        args = parse_args(argv)
        study = prepare(
            args.out,
            canaries=args.canaries,
            canary_len=args.canary_len,
            repetitions=args.repetitions,
            seed=args.seed,
            corpus_bytes=args.corpus_bytes,
        )
    except (StudyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, info in study["files"].items():
        print(
            f"{args.out / name}.bin: {info['train_tokens']} training tokens,"
            f" canaries {info['canary_share']:.1%}"
        )
    print(f"{args.out / 'val.bin'}: {study['val_tokens']} tokens; {args.out / 'canaries.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
