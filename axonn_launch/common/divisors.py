"""Divisors and the short lists of valid values that one-line errors name. Torch-free,
below ``common/arch/`` and ``common/rules.py``, which both name valid values."""

from __future__ import annotations

LISTED_DIVISORS = 12  # a "valid" list names at most this many values


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def listed_divisors(n: int) -> str:
    """The divisors of ``n`` as an error names them: the first few, then where they end."""
    values = divisors(n)
    if len(values) <= LISTED_DIVISORS:
        return ", ".join(map(str, values))
    return ", ".join(map(str, values[:LISTED_DIVISORS])) + f", ... (the divisors of {n})"


def listed(values: list[int]) -> str:
    """The first few ``values``, "..." when there are more, "none" when there are none."""
    shown = ", ".join(map(str, values[:LISTED_DIVISORS]))
    return shown + (", ..." if len(values) > LISTED_DIVISORS else "") if values else "none"
