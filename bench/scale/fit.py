"""Least-squares fits of a phase's seconds against the node count, and extrapolations.

Each model is ``a + b * f(N)`` with ``f`` linear, ``N log2 N`` or quadratic; the one with
the smallest root-mean-square residual is named best; when its slope is negative (no
growth measured) the phase is extrapolated as the mean of its points ("constant"). With
as many points as this host measures (4 or 5), the fits tell a trend, not a law: every
figure they give is labelled extrapolated.
"""

from __future__ import annotations

import math

MODELS = {
    "linear": lambda n: n,
    "n_log_n": lambda n: n * math.log2(n),
    "quadratic": lambda n: n * n,
    "constant": lambda n: 0.0,  # used only when the best fit's slope is negative
}


def fit_one(nodes: list[int], seconds: list[float], shape) -> tuple[float, float, float]:
    """``(a, b, rms residual)`` of ``seconds ~ a + b * shape(nodes)``."""
    xs = [shape(n) for n in nodes]
    mean_x, mean_y = sum(xs) / len(xs), sum(seconds) / len(seconds)
    var = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, seconds)) / var if var else 0.0
    a = mean_y - b * mean_x
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, seconds)) / len(xs))
    return a, b, rms


def fit_phase(nodes: list[int], seconds: list[float], targets: list[int]) -> dict:
    """Every model's coefficients and residual, the best one, and its extrapolations."""
    fits = {}
    for name, shape in MODELS.items():
        if name == "constant":
            continue
        a, b, rms = fit_one(nodes, seconds, shape)
        fits[name] = {"a": a, "b": b, "rms_residual_s": rms}
    best = min(fits, key=lambda name: fits[name]["rms_residual_s"])
    a, b = fits[best]["a"], fits[best]["b"]
    if b < 0:  # no growth measured: the mean, not a line falling below zero
        mean = sum(seconds) / len(seconds)
        rms = math.sqrt(sum((y - mean) ** 2 for y in seconds) / len(seconds))
        fits["constant"] = {"a": mean, "b": 0.0, "rms_residual_s": rms}
        best, a, b = "constant", mean, 0.0
    return {
        "fits": fits,
        "best": best,
        "extrapolated_s": {str(n): a + b * MODELS[best](n) for n in targets},
    }
