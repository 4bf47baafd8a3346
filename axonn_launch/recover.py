"""``python -m axonn_launch.recover <attempt dir>``: the recovery step a failed attempt's
chained recovery job runs (``submit/recovery.py``). People need not call it."""

from __future__ import annotations

import sys
from pathlib import Path

from axonn_launch.submit.recovery import recover


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m axonn_launch.recover <attempt dir>", file=sys.stderr)
        return 2
    print(recover(Path(args[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
