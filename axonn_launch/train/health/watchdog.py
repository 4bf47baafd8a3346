"""Each rank's progress watchdog, and the straggler score.

A rank marks its sections on a ``Watchdog``; a daemon thread compares the time in the
current section with its deadline and, when one passes, gathers every rank's stack and
heartbeat, names the ranks that stopped making progress (``find_suspects``), writes a
``hang`` failure record and ends the process. ``straggler_report`` names the ranks whose
compute time per step is far above the median.

In a hang every rank's deadline passes at about the same time, and every rank fires. One
of them, the first to claim it (``COLLECTOR``, created exclusively), reads the heartbeats
and publishes its suspects (``VERDICT``); the others take that verdict, so a hang costs
the shared file system one reading of every heartbeat, not one per firing rank (O(ranks),
not O(ranks²)). A collector that gives no verdict in time is replaced by each waiting
rank's own reading.

The shared file system sees one ``stat`` of the request per node per beat, not one per
rank: one rank of each node relays it into a node-local folder (``NodeRelay``), which
each rank's beat looks at; another takes over when it stops.

The deadlines, the steps of a hang and the cost at scale: ``docs/recovery.md``
("train/health/watchdog.py").
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common import failure_classes, jobdir
from axonn_launch.common.jobdir import (
    JobPaths,
    read_json_or_none,
    record_failure,
    write_json_atomically,
)
from axonn_launch.common.spec import StragglerConfig, WatchdogConfig

log = logging.getLogger(__name__)

HANG = failure_classes.HANG  # the failure record's class
HANG_EXIT = 75  # a rank that detected a hang ends with this code
REQUEST = jobdir.HANG_REQUEST
# a step's sections in order: a rank in a later one has made more progress
SECTION_ORDER = {"init": 0, "data": 1, "compute": 2, "sync": 3, "eval": 4, "checkpoint": 5}
ANSWER_BEATS = 3  # beats to wait for the other ranks' answers
# how long a collection may take: its answer window and a margin (a claim or a verdict
# this much older than a firing rank's request is an earlier hang's)
COLLECT_BEATS = ANSWER_BEATS + 2
COLLECT_MARGIN_S = 5.0
NODE_DIR_VAR = "AXONN_NODE_DIR"  # where a node's ranks share the relayed request (a tmpfs)
RELAY_DUE = 0.9  # the node's relay looks at the shared request again after this many beats
TAKEOVER = 1.5  # a stamp this many beats old: the relay is gone, another rank takes over


class Hang(RuntimeError):
    """What the failure record of a rank that detected a hang names."""


# --- the deadlines ---------------------------------------------------------------------------


def step_deadline(cfg: WatchdogConfig, step_times: list[float], steps_done: int) -> float:
    """Seconds a step may take: the start-up grace for the first ``startup_steps`` steps
    of an attempt, then ``step_factor`` times the median step so far, at least the floor."""
    if steps_done < cfg.startup_steps or not step_times:
        return cfg.startup_s
    return max(cfg.step_floor_s, cfg.step_factor * statistics.median(step_times))


def checkpoint_deadline(cfg: WatchdogConfig, bytes_per_node: float) -> float:
    """Seconds a save may take: its bytes per node at the file system's share of a node
    (``checkpoint_gbps``), ``checkpoint_factor`` times over, plus the floor."""
    if cfg.checkpoint_gbps <= 0:
        return cfg.checkpoint_floor_s
    return cfg.checkpoint_floor_s + cfg.checkpoint_factor * bytes_per_node / (
        cfg.checkpoint_gbps * 1e9
    )


def eval_deadline(cfg: WatchdogConfig, step_deadline_s: float) -> float:
    """Each evaluation batch's deadline: the clock restarts at every batch
    (``StepMonitor.eval_batch_done``), so an evaluation of any length is never a hang."""
    return max(cfg.eval_floor_s, step_deadline_s)


def collective_timeout(cfg: WatchdogConfig, step_deadline_s: float) -> float | None:
    """The collectives' timeout once start-up is over (None: keep the start-up one). It
    is longer than the step deadline, so that the watchdog speaks first."""
    return cfg.collective_factor * step_deadline_s if cfg.collective_factor > 0 else None


# --- naming the ranks that stopped -----------------------------------------------------------


def progress(beat: dict) -> tuple[int, int]:
    return int(beat.get("step", 0)), SECTION_ORDER.get(str(beat.get("section")), 0)


def answered(beat: dict | None, asked_at: float) -> bool:
    """The heartbeat answers the request whose file time is ``asked_at``: it names that
    time (read from the same file, so no two nodes' clocks are compared)."""
    return beat is not None and float(beat.get("answered", 0)) >= asked_at


def find_suspects(beats: dict[int, dict | None], asked_at: float) -> list[int]:
    """The ranks that stopped making progress, from every rank's heartbeat (None: none).

    A rank that did not answer the request made at ``asked_at`` is stopped or gone, and
    is named alone: its peers wait for it at different points. When all answered, those
    furthest behind are named if another rank is further ahead; when all are at the same
    point (a deadlock, or all waiting on something outside the job) no one is named.
    """
    silent = [r for r, b in sorted(beats.items()) if not answered(b, asked_at)]
    if silent:
        return silent
    points = {rank: progress(beat) for rank, beat in beats.items() if beat is not None}
    if not points or len(set(points.values())) == 1:
        return []
    least = min(points.values())
    return sorted(rank for rank, point in points.items() if point == least)


# --- the request, relayed once per node ------------------------------------------------------


def node_local_base(environ=os.environ) -> Path:
    """A folder on the node itself: ``AXONN_NODE_DIR``, else ``/dev/shm``, else the temp dir."""
    if environ.get(NODE_DIR_VAR):
        return Path(environ[NODE_DIR_VAR])
    shm = Path("/dev/shm")
    return shm if os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class NodeRelay:
    """The shared request file, seen by a node's ranks through a node-local copy.

    One rank of the node, the first to find no fresh stamp in the node-local folder,
    becomes its relay: at each beat it stamps the folder, looks at the shared request
    (one ``stat`` on the shared file system) and copies a newer request's time onto the
    node-local request, which every rank of the node looks at. The stamp says which rank
    wrote it (its nanoseconds end in the rank); when it is ``TAKEOVER`` beats old, the
    relay stopped or is gone, and the next rank to see that takes its place. The other
    ranks never touch the shared file system in steady state."""

    def __init__(
        self, shared_request: Path, job_dir: Path, node: str, beat_s: float, rank: int = 0
    ) -> None:
        key = hashlib.sha1(str(Path(job_dir).resolve()).encode()).hexdigest()[:16]
        self.folder = node_local_base() / f"axonn-{key}" / node
        self.shared, self.beat_s, self.rank = shared_request, beat_s, rank
        self.request, self.stamp = self.folder / REQUEST, self.folder / "relayed"
        self.stamped_ns = -1  # the stamp this rank wrote last
        self.direct = False  # no node-local folder: the shared request, as before the relay

    def due(self) -> bool:
        """Whether this rank relays now: it is the relay and a beat passed, or no relay
        stamped for ``TAKEOVER`` beats."""
        stamped = mtime_ns(self.stamp)
        if stamped is None:
            return True
        age = time.time() - stamped / 1e9
        return age >= TAKEOVER * self.beat_s or (
            stamped == self.stamped_ns and age >= RELAY_DUE * self.beat_s
        )

    def relay(self, force: bool = False) -> None:
        """Copy the shared request's time onto the node's, when due (or ``force``d: a rank
        that fired, without taking the relay's place)."""
        if self.direct or not (force or self.due()):
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not force:
                self.stamped_ns = time.time_ns() // 1000 * 1000 + self.rank % 1000
                self.stamp.touch()
                os.utime(self.stamp, ns=(self.stamped_ns, self.stamped_ns))
            asked = mtime_ns(self.shared)
            if asked is not None and asked > (mtime_ns(self.request) or 0):
                self.request.touch()
                os.utime(self.request, ns=(asked, asked))
        except OSError as error:  # this rank looks at the shared request itself from now on
            self.direct = True
            log.warning("watchdog: cannot relay the request in %s (%s): this rank looks at"
                        " the shared one at each beat", self.folder, error)  # fmt: skip

    def request_time(self) -> float | None:
        """The request's time as ``stat`` gives it on the shared file (the same float: the
        node's copy has the same nanoseconds), which the answers are compared with."""
        try:
            return (self.shared if self.direct else self.request).stat().st_mtime
        except OSError:
            return None

    def clean(self) -> None:
        """Leave nothing on the node (a rank still running makes it again at its beat)."""
        with contextlib.suppress(OSError):  # not empty: another rank or node is still there
            for path in (self.stamp, self.request):
                path.unlink(missing_ok=True)
            self.folder.rmdir()
            self.folder.parent.rmdir()


# --- the watchdog ----------------------------------------------------------------------------


@dataclass
class Section:
    name: str
    step: int
    since: float  # wall clock (time.time) when its clock started
    deadline_s: float


class Watchdog:
    """One rank's watchdog (see the module docstring). ``enter`` starts a section with a
    new clock; ``mark`` moves to the next section of the same step, on the same clock."""

    def __init__(
        self,
        cfg: WatchdogConfig,
        job_dir: str | Path,
        *,
        rank: int,
        world_size: int,
        node: str,
        end: Callable[[int], None] = os._exit,
    ) -> None:
        self.cfg, self.paths = cfg, JobPaths(job_dir)
        self.rank, self.world_size, self.node = rank, world_size, node
        self.end = end
        self.section = Section("init", 0, time.time(), cfg.startup_s)
        self.answered = 0.0  # the last request this rank answered
        self.graced_since: float | None = None  # the section clock given one more deadline
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.relay = NodeRelay(self.paths.hang_request, self.paths.folder, node, cfg.beat_s, rank)

    # the main thread's side: only assignments

    def enter(self, name: str, step: int, deadline_s: float) -> None:
        self.section = Section(name, step, time.time(), deadline_s)

    def mark(self, name: str) -> None:
        current = self.section
        self.section = Section(name, current.step, current.since, current.deadline_s)

    def start(self) -> Watchdog:
        self.write_heartbeat()
        self.thread = threading.Thread(target=self.watch, name="axonn-watchdog", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=self.cfg.beat_s + 5)
        self.relay.clean()

    # the watchdog thread's side

    def watch(self) -> None:
        # a random phase: the ranks of a node, started together, do not all claim its relay at once
        if self.stopping.wait(random.uniform(0, self.cfg.beat_s)):
            return
        while not self.stopping.wait(self.cfg.beat_s):
            self.answer_request()
            section = self.section
            if time.time() - section.since > self.allowed_s(section) and self.fire(section):
                return

    def allowed_s(self, section: Section) -> float:
        """The section's deadline, twice over once every rank was found alive at the same
        point when it first passed (``fire``)."""
        return section.deadline_s * (2 if section.since == self.graced_since else 1)

    def request_time(self) -> float | None:
        """The newest request's time, as relayed onto this node (``NodeRelay``)."""
        self.relay.relay()
        return self.relay.request_time()

    def answer_request(self) -> None:
        asked = self.request_time()
        if asked is not None and asked > self.answered:
            self.answered = asked
            self.dump_stacks()
            self.write_heartbeat()

    def write_heartbeat(self) -> None:
        section = self.section
        beat = {
            "rank": self.rank,
            "node": self.node,
            "section": section.name,
            "step": section.step,
            "since": section.since,
            "beat": time.time(),
            "answered": self.answered,  # the request file's time this beat answers
        }
        try:
            write_json_atomically(self.paths.heartbeat(self.rank), beat)
        except OSError as error:  # a full or read-only disk: the log line still names it
            log.warning("watchdog: cannot write heartbeat: %s", error)

    def dump_stacks(self) -> None:
        path = self.paths.stack_dump(self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as handle:
                section = self.section
                handle.write(
                    f"rank {self.rank} ({self.node}) in section {section.name} of step "
                    f"{section.step} for {time.time() - section.since:.1f} s\n"
                )
                handle.flush()
                faulthandler.dump_traceback(handle, all_threads=True)
        except OSError as error:
            log.warning("watchdog: cannot write stacks: %s", error)

    def ask_everyone(self) -> float:
        """Create (or refresh) the request; returns its time."""
        path = self.paths.heartbeats / REQUEST
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return path.stat().st_mtime

    def collection_s(self) -> float:
        """The longest a collection takes (``COLLECT_BEATS``, with a margin)."""
        return COLLECT_BEATS * self.cfg.beat_s + COLLECT_MARGIN_S

    def verdict(self, asked_at: float, section: Section) -> tuple[list[dict], int]:
        """The hang's suspects and the rank that named them: an earlier firing rank's
        verdict for this hang, else this rank's own collection when it claims it, else the
        collector's verdict once published (this rank's own collection if none comes)."""
        found = self.fresh_verdict(asked_at, section)
        if found is None and not self.claim(asked_at):
            found = self.wait_verdict(asked_at, section)
        if found is not None:
            return list(found.get("suspects") or []), int(found.get("rank", -1))
        beats = self.collect_beats(asked_at)
        suspects = [
            describe_suspect(r, beats.get(r), asked_at) for r in find_suspects(beats, asked_at)
        ]
        self.publish(asked_at, section, suspects)
        return suspects, self.rank

    def round_of(self, section: Section) -> int:
        """0 at a section's first deadline, 1 after its grace (``allowed_s``)."""
        return int(section.since == self.graced_since)

    def fresh_verdict(self, asked_at: float, section: Section) -> dict | None:
        """The published verdict when it is this hang's: the same step and round, asked
        within a collection's time of this rank's request (both times are the request
        file's, on the same file system's clock)."""
        found = read_json_or_none(self.paths.hang_verdict)
        if not isinstance(found, dict):
            return None
        same = found.get("step") == section.step and found.get("round") == self.round_of(section)
        fresh = float(found.get("asked", 0)) >= asked_at - self.collection_s()
        return found if same and fresh else None

    def claim(self, asked_at: float) -> bool:
        """Whether this rank collects: it created the claim, or found only an earlier
        hang's (older than a collection) and replaced it."""
        path = self.paths.hang_collector
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return True
            except FileExistsError:
                claimed = mtime_ns(path)
                if claimed is None or claimed / 1e9 >= asked_at - self.collection_s():
                    return False  # gone meanwhile: its collector just published
                with contextlib.suppress(OSError):
                    path.unlink()
            except OSError as error:  # no claim possible: read the heartbeats here
                log.warning("watchdog: cannot claim the collection (%s)", error)
                return True
        return False

    def wait_verdict(self, asked_at: float, section: Section) -> dict | None:
        """The collector's verdict, looked at once a beat while this rank answers requests
        as usual; None when none came within a collection's time and a beat."""
        wait_until = time.time() + self.collection_s() + self.cfg.beat_s
        while time.time() < wait_until:
            time.sleep(self.cfg.beat_s)
            self.relay.relay(force=True)
            self.answer_request()
            found = self.fresh_verdict(asked_at, section)
            if found is not None:
                return found
        log.warning("watchdog: no verdict from the collecting rank in %.0f s: reading the"
                    " heartbeats here", self.collection_s())  # fmt: skip
        return None

    def publish(self, asked_at: float, section: Section, suspects: list[dict]) -> None:
        """This rank's verdict for the others, then the claim released (the next hang's
        first firing rank claims anew)."""
        verdict = {"rank": self.rank, "node": self.node, "step": section.step,
                   "round": self.round_of(section), "asked": asked_at,
                   "suspects": suspects}  # fmt: skip
        try:
            write_json_atomically(self.paths.hang_verdict, verdict)
            self.paths.hang_collector.unlink(missing_ok=True)
        except OSError as error:
            log.warning("watchdog: cannot publish the hang's verdict: %s", error)

    def collect_beats(self, asked_at: float) -> dict[int, dict | None]:
        """Every rank's heartbeat, waiting up to ``ANSWER_BEATS`` beats for the answers; a
        rank's file is read again only until it answered."""
        wait_until = time.time() + ANSWER_BEATS * self.cfg.beat_s + 1
        beats: dict[int, dict | None] = {r: None for r in range(self.world_size)}
        while True:
            for rank in [r for r, b in beats.items() if not answered(b, asked_at)]:
                beats[rank] = self.read_beat(rank)
            if all(answered(b, asked_at) for b in beats.values()) or time.time() > wait_until:
                return beats
            time.sleep(min(0.5, self.cfg.beat_s))
            self.relay.relay(force=True)  # this node's ranks see the request at their beat
            self.answer_request()  # another rank that fired asks too: answer it meanwhile

    def read_beat(self, rank: int) -> dict | None:
        found = read_json_or_none(self.paths.heartbeat(rank))
        return found if isinstance(found, dict) else None

    def fire(self, section: Section) -> bool:
        """Ask every rank, then end the process with a hang record; True when it ended.
        When every rank answers at the same point, the first time for this section's clock,
        all are alive and equally slow (a loaded machine, a slow file system): the section
        gets one more deadline, with a warning, before that is a hang too."""
        stalled = time.time() - section.since
        self.answered = asked_at = self.ask_everyone()
        self.dump_stacks()
        self.write_heartbeat()
        suspects, collector = self.verdict(asked_at, section)
        if not suspects and self.graced_since != section.since:
            self.graced_since = section.since
            log.warning(
                "watchdog: section %s of step %d took %.0f s (deadline %.0f s); every rank "
                "is alive at the same point: one more deadline before it is a hang",
                section.name, section.step, stalled, section.deadline_s,
            )  # fmt: skip
            return False
        message = hang_line(self.rank, self.node, section, stalled, suspects, self.paths.stacks)
        print(message, file=sys.stderr, flush=True)
        log.error(message)
        evidence = {
            "failure_class": HANG,
            "section": section.name,
            "step": section.step,
            "stalled_s": round(stalled, 1),
            "deadline_s": section.deadline_s,
            "suspects": suspects,
            "stacks": str(self.paths.stacks),
            "collected_by": collector,  # the rank that read every heartbeat
        }
        record_failure(self.paths.folder, self.rank, Hang(message), evidence)
        logging.shutdown()
        self.end(HANG_EXIT)
        return True


def describe_suspect(rank: int, beat: dict | None, asked_at: float) -> dict:
    """A suspect's rank and node, and where it was when it answered (a silent rank,
    stopped or gone, has no section: its last heartbeat is older than the request)."""
    beat = beat or {}
    found = {"rank": rank, "node": str(beat.get("node", "?"))}
    if answered(beat, asked_at):
        found |= {"section": beat.get("section"), "step": beat.get("step")}
    return found


def suspect_words(suspect: dict) -> str:
    where = f"rank {suspect['rank']} ({suspect['node']})"
    if suspect.get("section") is None:
        return f"{where}, silent"
    return f"{where} in section {suspect['section']} of step {suspect['step']}"


def hang_line(
    rank: int, node: str, section: Section, stalled: float, suspects: list[dict], stacks: Path
) -> str:
    """The one line that says a rank saw a hang (records/failures.py recognises it)."""
    named = ", ".join(suspect_words(s) for s in suspects) or "none named"
    return (
        f"axonn_launch watchdog: hang: rank {rank} ({node}) saw no progress in section "
        f"{section.name} of step {section.step} for {stalled:.0f} s (deadline "
        f"{section.deadline_s:.0f} s); without progress: {named}; stacks in {stacks}"
    )


# --- stragglers ------------------------------------------------------------------------------


SMALL_WORLD = 8  # below this many ranks each is compared with the others only


def robust_score(t: float, others: list[float]) -> tuple[float, float]:
    """The median of ``others`` and ``t``'s robust score against them,
    ``(t - median) / (1.4826 * MAD)``, the MAD at least 2 % of the median (so that equal
    times do not make noise a straggler)."""
    median = statistics.median(others)
    mad = statistics.median(abs(o - median) for o in others)
    return median, (t - median) / (1.4826 * max(mad, 0.02 * median, 1e-9))


def straggler_scores(times: list[float]) -> tuple[float, list[tuple[float, float]]]:
    """The median of all, and each rank's (reference median, score): against every rank
    (itself included, which a robust median and MAD hardly notice) from ``SMALL_WORLD``
    ranks on, and against the other ranks below that, where one slow rank of two or four
    would pull the median and the MAD its way."""
    if len(times) >= SMALL_WORLD:
        median, _ = robust_score(0.0, times)
        return median, [robust_score(t, times) for t in times]
    scored = [robust_score(t, times[:i] + times[i + 1 :]) for i, t in enumerate(times)]
    return statistics.median(times), scored


def straggler_report(
    times: list[float],
    nodes: list[str],
    cfg: StragglerConfig,
    step: int,
    *,
    blocked: list[float] | None = None,
) -> dict:
    """``{"step", "median_s", "median_blocked_s", "stragglers": [...]}`` for the ranks' own
    work seconds per step ``times`` and blocked seconds per step ``blocked`` (index =
    rank); a straggler's own work scores over ``threshold`` and takes at least
    ``min_ratio`` times the median. Its blocked time is reported beside it: the slow rank
    waits least, its peers most (``train/health/monitor.py``)."""
    waits = blocked if blocked is not None else [0.0] * len(times)
    median, scored = straggler_scores(times)
    named = [
        {
            "rank": rank,
            "node": nodes[rank],
            "compute_s": round(t, 6),
            "blocked_s": round(waits[rank], 6),
            "ratio": round(t / reference, 2) if reference > 0 else None,
            "score": round(score, 1),
        }
        for rank, (t, (reference, score)) in enumerate(zip(times, scored, strict=True))
        if score > cfg.threshold and t >= cfg.min_ratio * reference
    ]
    return {
        "step": step,
        "median_s": round(median, 6),
        "median_blocked_s": round(statistics.median(waits), 6) if waits else 0.0,
        "stragglers": named,
    }


def persistent(report: dict, suspects: set[int]) -> tuple[dict, set[int]]:
    """``report`` naming only the ranks that were over the bar at the previous exchange
    too (``suspects``), and this exchange's ranks over the bar: a rank is named when it
    is slow in two windows in a row, so that a window in which the operating system
    happened to pause it (or start-up) names nobody."""
    over = {s["rank"] for s in report["stragglers"]}
    kept = [s for s in report["stragglers"] if s["rank"] in suspects]
    return report | {"stragglers": kept}, over


def straggler_line(report: dict) -> str:
    named = ", ".join(
        f"rank {s['rank']} ({s['node']}) {s['compute_s']:.3f} s/step of own work,"
        f" {s['ratio']}x, blocked {s.get('blocked_s', 0.0):.3f} s"
        for s in report["stragglers"]
    )
    return (
        f"stragglers at step {report['step']}: {named} (median own work"
        f" {report['median_s']:.3f} s, blocked {report.get('median_blocked_s', 0.0):.3f} s)"
    )


def write_stragglers(job_dir: str | Path, report: dict) -> None:
    try:
        write_json_atomically(JobPaths(job_dir).stragglers, report)
    except OSError as error:
        log.warning("cannot write %s: %s", JobPaths(job_dir).stragglers.name, error)
