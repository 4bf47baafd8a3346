"""``python -m axonn_launch.pack <pack dir>``: a packed sweep's allocation runs this; it runs
the pack's points as steps (``batch/pack_runner.py``). People need not call it."""

from __future__ import annotations

import sys
from pathlib import Path

from axonn_launch.batch.pack_runner import run_pack

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m axonn_launch.pack <pack dir>", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_pack(Path(sys.argv[1])))
