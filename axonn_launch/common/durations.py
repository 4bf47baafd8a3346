"""Spans of wall-clock time as a person reads them (summaries, status, reports)."""


def duration(seconds: float) -> str:
    """A wall-clock span in the unit a person would use."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 100 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
