"""The recovery job's process: run the recovery step (``submit/recovery.py``) on a failed
attempt, and stop the run in one line when the step itself fails. Its entry is
``python -m axonn_launch.recover <attempt dir>`` (``axonn_launch/recover.py``), the command
the recovery script names (``submit/chain.py``). People need not call it."""

from __future__ import annotations

import sys
from pathlib import Path

from axonn_launch.common.jobdir import read_record, run_root
from axonn_launch.submit.chain import STOPPED, set_chain, settings_of
from axonn_launch.submit.recovery import recover


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m axonn_launch.recover <attempt dir>", file=sys.stderr)
        return 2
    try:
        print(recover(Path(args[0])), flush=True)
    except Exception as exc:  # the chain must end in a state, never hang in "recovering"
        print(stop_after_error(Path(args[0]), exc), file=sys.stderr, flush=True)
        return 1
    return 0


def stop_after_error(job_dir: Path, exc: Exception) -> str:
    """Stop the run whose recovery step failed, saying why in one line."""
    why = f"the recovery step failed: {type(exc).__name__}: {exc}".splitlines()[0]
    try:
        record = read_record(job_dir)
        root = run_root(job_dir.resolve(), record)
        set_chain(root, settings_of(read_record(root)), state=STOPPED,
                  stop={"reason": why, "class": str(record.get("failure", ""))})  # fmt: skip
    except (OSError, ValueError) as error:
        return f"{why} (and its record could not be written: {error})"
    return f"{root}: stop: {why}"
