"""Interleaved on/off pairs: how the overhead benchmarks time an option and report it.

Each pair runs both arms back to back, in alternating order (on first in even pairs, off
first in odd ones), so load drifting over the run hits both arms alike. A pair's overhead
is on/off - 1; the figure reported is the median over pairs with the interquartile range
(IQR), and when the IQR holds zero the overhead is "below this machine's noise (±X %)",
X the larger end of the IQR, not a point figure. The machine's load average is read
before and after (``os.getloadavg``), since the machine is shared.

Used by ``bench_watchdog.py`` and ``bench_sinks.py``; no torch import.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

MIN_PAIRS = 10


def load_now() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages."""
    return os.getloadavg()


def load_line(before: tuple[float, ...], after: tuple[float, ...]) -> str:
    fmt = "/".join
    return (
        f"load average (1/5/15 min) before {fmt(f'{v:.1f}' for v in before)}, "
        f"after {fmt(f'{v:.1f}' for v in after)}"
    )


def interleaved(
    run_on: Callable[[int], float], run_off: Callable[[int], float], pairs: int
) -> list[dict[str, float]]:
    """``pairs`` pairs of ``{"on": s, "off": s}``, the arms' order alternating by pair."""
    out = []
    for i in range(pairs):
        arms = [("on", run_on), ("off", run_off)]
        if i % 2:
            arms.reverse()
        out.append({name: fn(i) for name, fn in arms})
        print(f"pair {i + 1}/{pairs}: {out[-1]}", flush=True)
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3), inclusive method (a sample of 1 gives its value three times)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def ratios(pairs: list[dict[str, float]]) -> list[float]:
    return [p["on"] / p["off"] - 1 for p in pairs]


def verdict(overheads: list[float]) -> str:
    """The overhead in words: a point figure with its IQR, or below the noise."""
    q1, median, q3 = quartiles(overheads)
    spread = f"median {median:+.2%}, IQR {q1:+.2%} to {q3:+.2%} over {len(overheads)} pairs"
    if q1 <= 0 <= q3:
        noise = max(abs(q1), abs(q3))
        return f"**below this machine's noise (±{noise:.1%})** ({spread})"
    return f"**{median:+.2%}** ({spread})"


def difference(values: list[float], scale: float = 1e6, unit: str = "µs") -> str:
    """Differences of seconds (on - off) in words: median and IQR, or below the noise."""
    q1, median, q3 = (v * scale for v in quartiles(values))
    spread = f"median {median:.0f} {unit}, IQR {q1:.0f} to {q3:.0f} {unit}"
    if q1 <= 0 <= q3:
        return f"below this machine's noise (±{max(abs(q1), abs(q3)):.0f} {unit}; {spread})"
    return spread


def pair_table(
    pairs: list[dict[str, float]], unit: str = "step s", scale: float = 1.0, digits: int = 4
) -> list[str]:
    """A markdown table of the pairs, each value times ``scale``."""
    lines = [f"| pair | {unit}, on | {unit}, off | on/off - 1 |", "|---|---|---|---|"]
    for i, (pair, r) in enumerate(zip(pairs, ratios(pairs), strict=True), 1):
        on, off = pair["on"] * scale, pair["off"] * scale
        lines.append(f"| {i} | {on:.{digits}f} | {off:.{digits}f} | {r:+.2%} |")
    return lines
