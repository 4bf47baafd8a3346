"""``python -m axonn_launch.jobs status|resubmit|stop|logs|sync``: what happened to my jobs, and
bring back the ones worth bringing back.

``status`` prints one row per job directory and why each failed job failed; ``resubmit``
submits a new attempt of each failed job whose class allows it (``batch/resubmit.py``);
``logs`` prints (and follows) a job's rank logs, by rank, node or the first failure
(``records/logs.py``); ``sync`` uploads a run's offline W&B runs.
``--help`` shows the options. Login-node code: never imports torch.

The columns and where states come from: ``docs/launch.md`` ("jobs.py").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from axonn_launch.batch.resubmit import MAX_ATTEMPTS, resubmit_one
from axonn_launch.common.jobdir import JobPaths, RecordError, read_record, run_root
from axonn_launch.records import curves, failures, goodput
from axonn_launch.records import logs as job_logs
from axonn_launch.records.evidence import finished_by_itself
from axonn_launch.records.jobdirs import DEFAULT_ROOT, JOB_DIR_HINT, NotAJobPath
from axonn_launch.records.runs import pack_lines, runs
from axonn_launch.records.status import (
    UNREADABLE_STATE,
    JobStatus,
    collect,
    straggler_line,
    unreachable_line,
)
from axonn_launch.submit import chain
from axonn_launch.usage import run_tool

# --- status output -------------------------------------------------------------------------

# Narrow enough for a 120-column terminal with the launcher's job dirs; the name, machine,
# model, nodes, step time, attempt and action are in --json (the name and machine are in
# the dir; the action is on the line under the table that says why the job ended).
COLUMNS = (
    ("JOB ID", lambda s: s.job_id or "-"),
    ("GRID", lambda s: short_grid(s.grid)),
    ("STATE", lambda s: s.state),
    ("STEP", lambda s: f"{s.step if s.step is not None else '-'}/{s.steps}"),
    ("LOSS", lambda s: f"{s.loss:.4g}" if s.loss is not None else "-"),
    ("TOK/S", lambda s: f"{s.tokens_per_s:.0f}" if s.tokens_per_s is not None else "-"),
    ("CLASS", lambda s: s.failure or "-"),
    ("RUN", lambda s: f"{s.run_state or '-'}" + (f" x{s.attempts}" if s.attempts > 1 else "")),
    ("GOODPUT", lambda s: f"{s.goodput['goodput']:.0%}" if s.goodput else "-"),
    ("DIR", lambda s: shown_dir(s.job_dir)),
)


def short_grid(grid: str) -> str:
    """``data=1 x=2 y=1 z=2`` as ``x2z2``: the axes above 1 (``x1`` for a single rank, read
    as the others are: one rank along x)."""
    axes = [word.split("=") for word in grid.split()]
    text = "".join(f"{'d' if a == 'data' else a}{n}" for a, n in axes if n != "1")
    return text or ("x1" if axes else "-")


def shown_dir(job_dir: str) -> str:
    """The job dir relative to the current directory when it is inside it."""
    relative = os.path.relpath(job_dir)
    return job_dir if relative.startswith("..") else relative


def format_table(rows: list[JobStatus]) -> str:
    """The table; the RUN column only when a run recovers itself, GOODPUT only when a run
    has ended (room for long dirs)."""
    optional = {"RUN": any(r.run_state for r in rows), "GOODPUT": any(r.goodput for r in rows)}
    shown = [c for c in COLUMNS if optional.get(c[0], True)]
    cells = [[name for name, _ in shown]] + [[get(r) for _, get in shown] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(shown) - 1)]
    return "\n".join(
        "  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]) for row in cells
    )


def status_main(args: argparse.Namespace) -> int:
    rows = collect(args.paths or [DEFAULT_ROOT], later_attempts=True)
    if not args.attempts:
        rows = runs(rows)  # a run that recovered itself is one row (--attempts: the chain)
    for root in {r.run_dir for r in rows if r.run_state == chain.DONE}:
        chain.settle_done(Path(root))  # chain.state says done from now on
    for said in curves.log_ended_runs(rows):  # an ended run's goodput beside its curves, once
        print(f"warning: {said}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    said = unreachable_line(rows)
    if said:
        print(said)
    print(format_table(rows))
    for row in rows:
        who = shown_dir(row.job_dir) if row.state == UNREADABLE_STATE else row.job_id
        for note in notes(row):
            print(f"  {who or Path(row.job_dir).name}: {note}")
    for line in pack_lines(args.paths or [DEFAULT_ROOT], rows):  # a packed sweep's packs
        print(line)
    return 0


def notes(row: JobStatus) -> list[str]:
    """The lines under the table for one job: why it failed and what to do, what failed
    after a finished training, and its slow nodes."""
    if row.state == UNREADABLE_STATE:  # job.json failed its schema: that is all there is
        return list(row.problems)
    lines = [row.reason] if row.unreachable else []  # its last known state and age
    if row.resubmitted_as:
        lines.append(f"resubmitted as {row.resubmitted_as}")
        if row.failure in failures.DIAGNOSED_CLASSES and row.reason:  # what the ranks saw
            lines.append(f"{row.failure}: {row.reason}")
    elif row.failure not in ("", failures.COMPLETED, failures.RUNNING) and row.reason:
        lines.append(f"{row.reason} (action: {row.action})")
    elif row.failure == failures.COMPLETED:
        lines += after_training_notes(row)
    if row.expected_start:
        lines.append(row.expected_start)
    if row.stop_reason and row.stop_reason not in row.reason:  # not said twice
        lines.append(f"run stopped: {row.stop_reason}")
    if row.excluded:
        lines.append(f"excluded nodes: {', '.join(row.excluded)}")
    if row.restarts_in_place:
        held = row.allocations_held
        lines.append(f"{row.attempts} attempts in {held} allocation{'s' * (held > 1)}"
                     f" ({len(row.restarts_in_place)} restarted in place)")  # fmt: skip
    if row.goodput and row.attempts > 1:  # where the failures' cost is worth a line
        lines.append(goodput.describe(row.goodput))
    if row.stragglers:
        lines.append(straggler_line(row))
    if row.slow_nodes and not any("slow nodes" in line for line in lines):
        lines.append(f"preflight named slow nodes: {', '.join(row.slow_nodes)}")
    return lines + row.problems  # records left out for failing their schema


def after_training_notes(row: JobStatus) -> list[str]:
    """A completed training's steps that did not finish, and how its job ended if not well."""
    lines = [row.reason] if row.reason.startswith("training finished, then") else []
    for name, outcome in row.after_training.items():
        if outcome != "done":
            shown = "did not finish" if outcome == "pending" else outcome
            lines.append(f"{name} after the training {shown}")
    return lines


def stop_main(args: argparse.Namespace) -> int:
    for path in args.paths:
        if not JobPaths(path).record.is_file():
            raise NotAJobPath(f"{path}: not a job dir; {JOB_DIR_HINT}")
        try:
            said = chain.stop(Path(path))
        except RecordError as error:  # nothing to trust, so nothing is cancelled
            raise RecordError(f"{path}: UNREADABLE {error}; nothing cancelled") from None
        print(said, flush=True)
    return 0


def resubmit_main(args: argparse.Namespace) -> int:
    bad = [c for c in args.only or [] if c not in failures.CLASSES]
    if bad:
        print(
            f"error: --only {' '.join(bad)}: valid classes: {', '.join(failures.CLASSES)}",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for status in collect(args.paths or [DEFAULT_ROOT], later_attempts=True):
        if status.state == UNREADABLE_STATE:  # nothing to act on: say so, go on
            failed += 1
            print(f"error {status.job_dir}: {status.reason}", flush=True)
            continue
        try:
            print(resubmit_one(status, args, sys.stdout), flush=True)
        except Exception as exc:  # bad override, sbatch refusal: report, go on with the rest
            failed += 1
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            print(f"error {status.job_id} {status.job_dir}: {reason}", flush=True)
    return 1 if failed else 0


# --- logs ----------------------------------------------------------------------------------

FOLLOW_POLL_S = 0.5


def logs_main(args: argparse.Namespace) -> int:
    job_dir = chosen_attempt(Path(args.path), args.attempt)
    record = read_record(job_dir)
    files = [p for rank in chosen_ranks(job_dir, record, args)
             for p in job_logs.rank_logs(job_dir, record, rank)]  # fmt: skip
    if not files:
        raise job_logs.LogsError(f"{job_dir}: no log files yet")
    offsets = {path: show_file(path, 0, len(files) > 1) for path in files}
    if args.follow:
        follow(job_dir, offsets, len(files) > 1)
    return 0


def chosen_attempt(path: Path, attempt: int | None) -> Path:
    """The job dir itself, or its run's attempt ``attempt`` (1: the first)."""
    if not JobPaths(path).record.is_file():
        raise NotAJobPath(f"{path}: not a job dir; {JOB_DIR_HINT}")
    if attempt is None:
        return path
    attempts = chain.attempts_of(run_root(path))
    if not 1 <= attempt <= len(attempts):
        raise job_logs.LogsError(
            f"--attempt {attempt}: the run of {path} has attempts 1 to {len(attempts)}"
        )
    return attempts[attempt - 1]


def chosen_ranks(job_dir: Path, record: dict, args: argparse.Namespace) -> list[int]:
    """The ranks ``--rank``, ``--node`` or ``--failed`` name; every rank with a log if none."""
    present = job_logs.ranks_with_logs(job_dir, record)
    if args.failed:
        rank = job_logs.failed_rank(job_dir, record)
        if rank is None:
            raise job_logs.LogsError(f"{job_dir}: no rank failed")
        print(f"rank {rank} failed first", flush=True)
        return [rank]
    if args.node is not None:
        ranks = job_logs.ranks_on_node(job_dir, args.node)
        if not ranks:
            raise job_logs.LogsError(f"--node {args.node}: no rank of {job_dir} logged from it")
        return ranks
    if args.rank is not None and args.rank not in present:
        shown = ", ".join(map(str, present)) or "none yet"
        raise job_logs.LogsError(f"--rank {args.rank}: no log in {job_dir}; ranks: {shown}")
    return [args.rank] if args.rank is not None else present


def show_file(path: Path, start: int, header: bool) -> int:
    """Print ``path`` from byte ``start`` (under a ``==> path <==`` line, as ``tail`` does
    for several files); returns where it ended."""
    with path.open("rb") as handle:
        handle.seek(start)
        data = handle.read()
    if data and header:
        print(f"==> {shown_dir(str(path))} <==", flush=True)
    sys.stdout.write(data.decode(errors="replace"))
    sys.stdout.flush()
    return start + len(data)


def follow(job_dir: Path, offsets: dict[Path, int], header: bool) -> None:
    """New lines as they come, until the job ends (its record or summary says so) or
    Ctrl-C."""
    try:
        while True:
            ended = attempt_ended(job_dir)
            for path, start in offsets.items():
                offsets[path] = show_file(path, start, header)
            if ended:
                return
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return


def attempt_ended(job_dir: Path) -> bool:
    try:
        record = read_record(job_dir)
    except (OSError, ValueError):
        return True
    return record.get("status") in ("completed", "failed") or finished_by_itself(job_dir, record)


# --- sync ----------------------------------------------------------------------------------


def sync_main(args: argparse.Namespace) -> int:
    """Upload the run's offline W&B runs (every attempt's folder, one run id) with wandb's
    own ``wandb sync``, which joins them in order of start."""
    root = run_root(chosen_attempt(Path(args.path), None))
    runs = JobPaths(root).wandb_offline_runs()
    if not runs:
        raise job_logs.LogsError(
            f"{args.path}: no offline W&B run in {JobPaths(root).wandb} (a run launched with"
            " 'metrics.sinks=[jsonl,tensorboard,wandb]' metrics.wandb.mode=offline writes them)"
        )
    here = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    wandb = shutil.which("wandb", path=here)  # this environment's first
    if wandb is None:
        raise job_logs.LogsError("wandb is not installed here: pip install -e '.[wandb]'")
    dry = ["--dry-run"] if args.dry_run else []
    return subprocess.run([wandb, "sync", *dry, *map(str, runs)]).returncode


# --- command line --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line instead of argparse's usage block; exit code 2."""
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


STATUS_EXAMPLES = (
    "python -m axonn_launch.jobs status                  # every job under jobs/",
    "python -m axonn_launch.jobs status --json jobs/sweeps/2026-11-29_10-00-00",
)
RESUBMIT_EXAMPLES = (
    "python -m axonn_launch.jobs resubmit jobs/ --dry-run  # what would be resubmitted, and why",
    "python -m axonn_launch.jobs resubmit jobs/gpt_80b-frontier/<time> nodes=64 grid=auto",
    "python -m axonn_launch.jobs resubmit jobs/gpt_tiny-local/<time> train.steps=400 wait=true"
    "  # 200 more",
)
LOGS_EXAMPLES = (
    "python -m axonn_launch.jobs logs jobs/gpt_tiny-local/<time> --failed",
    "python -m axonn_launch.jobs logs jobs/gpt_80b-frontier/<time> --rank 7 --follow",
    "python -m axonn_launch.jobs logs jobs/gpt_80b-frontier/<time> --attempt 1 --node nid001234",
)
RESUBMIT_NOTE = (
    "KEY=VALUE words are launcher overrides for the new attempts, validated like a launch.\n"
    "\n"
    "Extending a completed job: train.steps=N (above the step it completed) continues it from\n"
    "its last checkpoint to step N in <dir>_attempt<K>. The learning rate restarts there:\n"
    "warmup over train.warmup_steps, then a cosine from train.lr down to train.min_lr at\n"
    "step N (train.schedule_start is set to the checkpoint's step). Add train.warmup_steps=0\n"
    "train.lr=<min_lr> to go on at the final learning rate instead."
)


def _examples(lines: tuple[str, ...], note: str = "") -> str:
    return (note + "\n\n" if note else "") + "examples:\n" + "\n".join(f"  {x}" for x in lines)


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    top = _Parser(
        prog="python -m axonn_launch.jobs",
        description=f"What happened to my jobs, and bring back the failed ones; {JOB_DIR_HINT}.",
        epilog=_examples(STATUS_EXAMPLES + RESUBMIT_EXAMPLES),
        formatter_class=raw,
    )
    commands = top.add_subparsers(
        dest="command", required=True, metavar="{status,resubmit,stop,logs,sync}"
    )
    status = commands.add_parser(
        "status", help="one row per job", epilog=_examples(STATUS_EXAMPLES), formatter_class=raw
    )
    status.add_argument(
        "paths", nargs="*", help=f"job dirs or folders of them (default {DEFAULT_ROOT}/)"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--attempts", action="store_true", help="one row per attempt of a run, not per run"
    )
    again = commands.add_parser(
        "resubmit",
        help="resubmit the failed jobs whose failure class allows it; extend completed ones",
        usage="python -m axonn_launch.jobs resubmit [options] [PATH ...] [KEY=VALUE ...]",
        epilog=_examples(RESUBMIT_EXAMPLES, RESUBMIT_NOTE),
        formatter_class=raw,
    )
    again.add_argument(
        "paths", nargs="*", help=f"job dirs or folders of them (default {DEFAULT_ROOT}/)"
    )
    again.add_argument("--dry-run", action="store_true", help="say what would be submitted")
    again.add_argument(
        "--only",
        nargs="+",
        metavar="CLASS",
        help=f"only these classes: {', '.join(failures.CLASSES)} (completed: with train.steps=N)",
    )
    again.add_argument(
        "--max-attempts",
        type=int,
        default=MAX_ATTEMPTS,
        metavar="N",
        help="attempts per job, all told",
    )
    halt = commands.add_parser(
        "stop",
        help="end a run that recovers itself: its attempt and recovery job, nothing more submitted",
    )
    halt.add_argument("paths", nargs="+", help="the run's job dir (or any of its attempts)")
    shown = commands.add_parser(
        "logs", help="print a job's rank logs: one rank, one node's, or the first failure's",
        epilog=_examples(LOGS_EXAMPLES), formatter_class=raw,
    )  # fmt: skip
    shown.add_argument("path", help="a job dir (any attempt of a run)")
    which = shown.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="N", help="rank N's logs only")
    which.add_argument("--node", metavar="NAME", help="the logs of the ranks that ran on NAME")
    first = "the log of the rank that failed first (as jobs status names it)"
    which.add_argument("--failed", action="store_true", help=first)
    attempt = "the run's attempt N (1: the first) instead of PATH itself"
    shown.add_argument("--attempt", type=int, metavar="N", help=attempt)
    follow = "print new lines as they come, until the job ends or Ctrl-C"
    shown.add_argument("--follow", "-f", action="store_true", help=follow)
    upload = commands.add_parser(
        "sync", help="upload a run's offline W&B runs (wandb sync, from the login node)"
    )
    upload.add_argument("path", help="a job dir (any attempt of the run)")
    upload.add_argument("--dry-run", action="store_true", help="say what would be uploaded")
    for sub in (top, status, again, halt, shown, upload):
        sub.add_argument("--debug", action="store_true", help="show tracebacks")
    return top


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """KEY=VALUE words are overrides; everything else goes to argparse."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    return [a for a in argv if a not in overrides], overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(argv)
    args = parser().parse_args(rest)
    args.overrides = overrides
    if args.command in ("status", "stop", "logs", "sync") and overrides:
        print(f"error: {args.command} takes no overrides: {' '.join(overrides)}", file=sys.stderr)
        return 2
    run = {"status": status_main, "resubmit": resubmit_main, "stop": stop_main,
           "logs": logs_main, "sync": sync_main}[args.command]  # fmt: skip
    errors = (NotAJobPath, chain.NotOurJob, RecordError, job_logs.LogsError)
    return run_tool(lambda _: run(args), argv, errors)


if __name__ == "__main__":
    sys.exit(main())
