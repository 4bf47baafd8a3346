"""Plots and a report.md for a job, a sweep or a memorization study.

``python -m axonn_launch.report PATH [--out DIR] [--metric NAME] [--plan FILE]``. Loss,
tokens/s and step time are the job's own (``records.jobdirs.run_results``), so the report,
the console's ``done:`` line and ``jobs status`` agree. Login-node code: matplotlib is
imported only to draw (the ``plot`` extra); torch never.

What each kind of PATH gets: ``docs/launch.md`` ("report.py").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axonn_launch.common.jobdir import JobPaths, read_summary, run_root
from axonn_launch.records import goodput, profile
from axonn_launch.records.jobdirs import DRY_RUN_WORDS, dry_run_problem, run_results
from axonn_launch.records.runs import runs
from axonn_launch.records.status import collect
from axonn_launch.submit.chain import attempts_of
from axonn_launch.usage import raising_parser, run_tool

METRICS = ("final_loss", "val_loss", "tokens_per_s")
# each metric as a reader sees it: its words on an axis, its number in a table (tokens/s as a
# whole number, as the job's own table and `jobs status` show it, never 6.186e+04)
METRIC_LABELS = {"final_loss": "final loss", "val_loss": "validation loss",
                 "tokens_per_s": "tokens/s"}  # fmt: skip
METRIC_FORMS = {"tokens_per_s": "{:.0f}"}
# swept keys that change how a job runs, not what it computes: the loss is the same for
# every value (the same model, data and seed on any grid), the speed is what differs
HOW_IT_RUNS = (
    "grid", "nodes", "machine", "train.micro_batch", "train.overlap", "train.wire",
    "train.activation_checkpointing", "train.gemm_tuning", "train.cache_layers",
    "train.threads", "train.ors_window", "preflight", "hydra",
)  # fmt: skip
DRY_RUN_STATUS = "dry_run"  # a sweep point's status when the sweep was a dry run
REPETITION_KEYS = (
    "repetitions",
    "study.repetitions",  # conf/study/memorization.yaml
    "train.repetitions",
    "train.data_repetitions",
    "train.repeats",
    "data.repetitions",
)
Series = tuple[str, Sequence[float], Sequence[float]]  # (label, xs, ys)


class ReportError(ValueError):
    """Bad input to the report tool: one line."""


# --------------------------------------------------------------------------- reading


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_metrics(job_dir: Path) -> list[dict]:
    """Rows of ``metrics.jsonl`` (a torn last line, from a running job, is left out)."""
    rows = []
    path = JobPaths(job_dir).metrics
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def column(rows: Iterable[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the rows where both are finite numbers."""
    pairs = [(number(r.get(x)), number(r.get(key))) for r in rows]
    kept = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in kept], [b for _, b in kept]


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def job_config(job_dir: Path) -> dict[str, Any]:
    """The job's settings as dotted keys: ``config.yaml`` overlaid by ``spec.json``."""
    config: dict[str, Any] = {}
    if JobPaths(job_dir).config.is_file():
        import yaml

        try:
            config = flatten(yaml.safe_load(JobPaths(job_dir).config.read_text()) or {})
        except yaml.YAMLError:
            config = {}
    return config | flatten(read_json(JobPaths(job_dir).spec))


# ------------------------------------------------------------------------- plotting


def pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ReportError("matplotlib is missing: pip install -e '.[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path: Path, series: Sequence[Series], **options: Any) -> Path:
    """One PNG of ``series``, drawn by ``draw`` with ``options``."""
    plt = pyplot()
    fig, _ = draw(plt, series, **options)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw(
    plt: Any,
    series: Sequence[Series],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    points: bool = False,
    diagonal: bool = False,
    logx: bool = False,
    dashed: str = "",
    xticks: Sequence[tuple[float, str]] | None = None,
) -> tuple[Any, Any]:
    """(figure, axes) of ``series`` (lines, or markers with ``points``); series whose
    label starts with ``dashed`` are drawn dashed with crosses, so lines that coincide
    stay visible. ``xticks``: (position, label) of every tick, for values that are names
    or chosen numbers (a grid axis of 1 and 2 has no tick at 1.5). Tick labels are never
    shifted by an offset (``+5.512`` in a corner), which a reader misses."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, xs, ys in series:
        style = "o" if points else "-o" if len(xs) < 30 else "-"
        if dashed and label.startswith(dashed):
            style = style.replace("-", "--").replace("o", "x")
        ax.plot(xs, ys, style, label=label, ms=5)
    if logx:
        from matplotlib.ticker import ScalarFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    if diagonal:
        low = min(min(min(xs), min(ys)) for _, xs, ys in series)
        high = max(max(max(xs), max(ys)) for _, xs, ys in series)
        ax.plot([low, high], [low, high], "k--", lw=0.8, label="predicted = measured")
    if xticks is not None:
        set_ticks(ax, xticks)
    no_offset(ax)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if len(series) > 1 or diagonal:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, ax


TICK_CHARS = 48  # about what fits under a 6.4-inch plot at matplotlib's 10 pt labels


def set_ticks(ax: Any, ticks: Sequence[tuple[float, str]]) -> None:
    """Exactly these ticks (no minor labels beside them); slanted when side by side
    they would run together."""
    from matplotlib.ticker import NullFormatter

    labels = [label for _, label in ticks]
    ax.set_xticks([at for at, _ in ticks], labels)
    ax.xaxis.set_minor_formatter(NullFormatter())
    if sum(len(label) + 2 for label in labels) > TICK_CHARS:
        ax.tick_params(axis="x", labelrotation=30)
        for text in ax.get_xticklabels():
            text.set_horizontalalignment("right")


def no_offset(ax: Any) -> None:
    """Whole tick values on both axes, never ``+5.512`` or ``1e-3`` in a corner."""
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)


def fmt(value: Any, form: str = "{:.4g}") -> str:
    return "-" if number(value) is None else form.format(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# ------------------------------------------------------------------------ job report


def job_report(job_dir: Path, out: Path) -> list[str]:
    """report.md lines of one job; its PNGs written to ``out``."""
    rows = read_metrics(job_dir)
    if not rows:
        raise ReportError(f"{job_dir}: metrics.jsonl has no steps yet")
    record, summary, config = (
        read_json(JobPaths(job_dir).record),
        read_summary(job_dir) or {},
        job_config(job_dir),
    )
    name = str(record.get("name") or job_dir.name)
    per_step = (config.get("train.global_batch") or 0) * (config.get("train.seq_len") or 0)
    for row in rows:
        row["tokens"] = row["step"] * per_step
    images = [
        _loss_plot(rows, out, "step", name),
        *([_loss_plot(rows, out, "tokens", name)] if per_step else []),
    ]
    for key, label in (("lr", "learning rate"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU")):
        xs, ys = column(rows, key)
        if xs:
            images.append(
                plot(
                    out / f"{key}.png",
                    [(label, xs, ys)],
                    xlabel="step",
                    ylabel=label,
                    title=f"{label}: {name}",
                )
            )
    lines = [f"# Job {name}", "", f"`{job_dir}`", ""]
    lines += table(["key", "value"], _job_summary(job_dir, record, summary, rows, per_step))
    if not column(rows, "mfu")[0]:
        lines += ["", "No MFU: the machine profile has no peak (a CPU run)."]
    lines += goodput_section(job_dir)
    lines += profile_section(job_dir)
    lines += [""] + [f"![{p.stem}]({p.name})" for p in images]
    return lines


def profile_section(job_dir: Path) -> list[str]:
    """Collectives against compute per rank in the train.profile.steps window
    (records/profile.py); nothing without a profile."""
    found = profile.read_profiles(job_dir)
    if not found:
        return []
    where = "GPU kernels" if any(p.on_gpu for p in found) else "CPU ops (gloo)"
    lines = ["", "## Profile: collectives against compute", "", f"From the {where} of"
             f" `{JobPaths(job_dir).profile.name}/`; longest: the three ops or kernels that took"
             " the most time.", ""]  # fmt: skip
    return lines + table(profile.PROFILE_HEADER, profile.profile_rows(found))


def goodput_section(job_dir: Path) -> list[str]:
    """Where the run's allocated time went, over all its attempts (records/goodput.py);
    nothing while an attempt has not ended."""
    root = run_root(job_dir, read_json(JobPaths(job_dir).record))
    found = runs(collect([str(a) for a in attempts_of(root)]))[0].goodput
    if not found:
        return []
    allocated = found["allocated_s"]
    parts = [(part, f"{found[f'{part}_s']:.1f}", f"{found[f'{part}_s'] / allocated:.1%}")
             for part in goodput.PARTS]  # fmt: skip
    lines = ["", "## Goodput", "", goodput.describe(found), ""]
    return lines + table(
        ["part", "seconds", "of allocated"], [*parts, ("allocated", f"{allocated:.1f}", "100%")]
    )


def _loss_plot(rows: list[dict], out: Path, x: str, name: str) -> Path:
    series = [
        (name, *column(rows, key, x))
        for name, key in (("train", "loss"), ("validation", "val_loss"))
    ]
    series = [s for s in series if s[1]]
    title = f"loss against {x}: {name}"
    return plot(out / f"{'loss' if x == 'step' else 'loss_tokens'}.png", series, xlabel=x,
                ylabel="loss", title=title)  # fmt: skip


def _job_summary(
    job_dir: Path, record: dict, summary: dict, rows: list[dict], per_step: int
) -> list[tuple]:
    results = run_results(job_dir, rows[-1])  # the numbers jobs status and the console show
    val = column(rows, "val_loss")[1]
    grid = record.get("grid") or {}
    return [
        ("model", record.get("model", "-")),
        ("machine", record.get("machine", "-")),
        ("grid (data, x, y, z)", ", ".join(str(grid.get(a, "-")) for a in ("data", "x", "y", "z"))),
        ("status", record.get("status", "-")),
        ("steps", rows[-1]["step"]),
        ("tokens", f"{rows[-1]['step'] * per_step:,}" if per_step else "-"),
        ("final loss", fmt(results.loss)),
        ("final validation loss", fmt(val[-1] if val else None)),
        (_speed_label(summary), fmt(results.tokens_per_s, "{:.0f}")),
        ("step time s", fmt(results.step_time_s, "{:.3g}")),
        ("TFLOP/s per GPU", fmt(summary.get("tflops_per_gpu"), "{:.3g}")),
        ("MFU", fmt(summary.get("mfu"), "{:.1%}")),
    ]


def _speed_label(summary: dict) -> str:
    """What the tokens/s figure covers: the run's steps after the first (its warm-up, as the
    job's summary counts them), or, while it runs, its last logged step."""
    return "tokens/s (steps after the first)" if summary else "tokens/s (last step)"


# ---------------------------------------------------------------------- sweep report


@dataclass
class Point:
    num: int
    status: str
    overrides: dict[str, str]
    job_dir: Path | None

    def value(self, metric: str) -> float | None:
        if self.job_dir is None:
            return None
        if metric == "val_loss":
            values = column(read_metrics(self.job_dir), "val_loss")[1]
            return (
                values[-1] if values else number((read_summary(self.job_dir) or {}).get("val_loss"))
            )
        return number((read_summary(self.job_dir) or {}).get(metric))


def read_sweep(sweep_dir: Path) -> list[Point]:
    points = []
    paths = [p for p in (sweep_dir / "points").glob("*.json") if p.stem.isdigit()]
    for path in sorted(paths, key=lambda p: int(p.stem)):
        record = read_json(path)
        overrides = parse_point(str(record.get("point") or ""))
        job = record.get("job_dir")
        job_dir = (sweep_dir / job) if job else None
        job_dir = job_dir if job_dir is not None and job_dir.is_dir() else None
        points.append(
            Point(int(record.get("num", path.stem)), record.get("status", "?"), overrides, job_dir)
        )
    return points


def parse_point(point: str) -> dict[str, str]:
    """A point's overrides, ``+key=value`` and ``++key=value`` as ``key``."""
    pairs = (word.split("=", 1) for word in point.split() if "=" in word)
    return {key.lstrip("+"): value for key, value in pairs}


def swept_keys(points: Sequence[Point]) -> list[str]:
    keys = sorted({k for p in points for k in p.overrides})
    return [k for k in keys if len({p.overrides.get(k) for p in points}) > 1]


def as_number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def default_metric(points: Sequence[Point], keys: Sequence[str]) -> tuple[str, str]:
    """(metric, why) for a sweep report without ``--metric``.

    A sweep over how jobs run (grid, nodes, overlap, ...: ``HOW_IT_RUNS``) trains the same
    model on the same data, so its loss is the same for every value and its plot a flat
    line: it measures speed, tokens/s. Any other sweep measures the model: the validation
    loss where the jobs measured it (the sweeps' default objective), else the final loss.
    """
    if keys and all(_under(k, HOW_IT_RUNS) for k in keys):
        return "tokens_per_s", "every swept key changes how the jobs run, not what they compute"
    if any(p.value("val_loss") is not None for p in points):
        return "val_loss", "a swept key changes what the jobs compute; validation loss measured"
    return "final_loss", "a swept key changes what the jobs compute; no validation loss"


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") or key.startswith(p + "/") for p in prefixes)


def sweep_report(sweep_dir: Path, out: Path, metric: str | None) -> list[str]:
    points = read_sweep(sweep_dir)
    if not points:
        raise ReportError(f"{sweep_dir}: points/ holds no point records")
    keys = swept_keys(points)
    why = "--metric"
    if metric is None:
        metric, why = default_metric(points, keys)
    lines = [f"# Sweep {sweep_dir.name}", "", f"`{sweep_dir}`; metric: {metric} ({why})", ""]
    lines += table(
        ["#", *keys, "status", metric],
        [
            (
                p.num,
                *(p.overrides.get(k, "-") for k in keys),
                p.status,
                fmt(p.value(metric), METRIC_FORMS.get(metric, "{:.4g}")),
            )  # fmt: skip
            for p in points
        ],
    )
    lines.append("")
    for key in keys:
        image = _sweep_plot(points, key, [k for k in keys if k != key], metric, out)
        lines += [f"![{image.stem}]({image.name})"] if image else [f"({key}: no values to plot)"]
    lines += memorization_section(points, out)
    return lines


def _sweep_plot(
    points: Sequence[Point], key: str, others: list[str], metric: str, out: Path
) -> Path | None:
    groups: dict[str, list[tuple[Any, float]]] = defaultdict(list)
    for p in points:
        value = p.value(metric)
        if value is not None and key in p.overrides:
            label = " ".join(f"{k}={p.overrides.get(k, '-')}" for k in others) or metric
            groups[label].append((p.overrides[key], value))
    if not groups:
        return None
    numeric = all(as_number(x) is not None for pairs in groups.values() for x, _ in pairs)
    categories = sorted({x for pairs in groups.values() for x, _ in pairs})
    series = []
    for label, pairs in sorted(groups.items()):
        pairs.sort(key=lambda xy: as_number(xy[0]) if numeric else categories.index(xy[0]))
        xs = [as_number(x) if numeric else categories.index(x) for x, _ in pairs]
        series.append((label, xs, [y for _, y in pairs]))
    path = out / f"sweep_{metric}_{key.replace('/', '_')}.png"
    log = numeric and log_axis(key, [as_number(x) for x in categories])
    plot(
        path,
        series,
        xlabel=key + (" (log scale)" if log else ""),
        ylabel=METRIC_LABELS.get(metric, metric),
        title=f"{METRIC_LABELS.get(metric, metric)} against {key}",
        logx=log,
        xticks=sweep_ticks(categories, numeric, log=log),
    )
    return path


def log_axis(key: str, numbers: Sequence[float]) -> bool:
    """A learning rate, or positive values over a factor of 10 or more, are read on a log
    scale: an optimizer's trials spread evenly in log(lr) and crowd at the left of a
    linear axis."""
    if not numbers or min(numbers) <= 0:
        return False
    return key.rsplit(".", 1)[-1].endswith("lr") or max(numbers) >= 10 * min(numbers)


def sweep_ticks(
    values: Sequence[str], numeric: bool, *, log: bool = False
) -> list[tuple[float, str]] | None:
    """A tick at each swept value when they are names or a few whole numbers (a grid
    axis); on a log axis otherwise ticks at 1, 2 and 5 times powers of ten (``log_ticks``);
    None (matplotlib's own) for fractions on a linear axis."""
    if not numeric:
        return [(float(i), name) for i, name in enumerate(values)]
    numbers = sorted({as_number(v) for v in values})
    if len(numbers) <= 12 and all(n.is_integer() for n in numbers):
        return [(n, str(int(n))) for n in numbers]
    return log_ticks(numbers[0], numbers[-1]) if log else None


def log_ticks(low: float, high: float, most: int = 8) -> list[tuple[float, str]]:
    """Ticks from ``low`` to ``high`` (> 0) at 1, 2 and 5 times powers of ten, thinned to
    1 and 3, then to powers of ten, until at most ``most`` remain; at least two (more
    steps within a decade when the range is narrow). Labels are plain (``0.0003``)."""
    for steps in ((1, 2, 5), (1, 3), (1,)):
        ticks = _ticks_between(low, high, steps)
        if len(ticks) <= most:
            break
    if len(ticks) < 2:
        ticks = _ticks_between(low, high, range(1, 10))
    if len(ticks) < 2:
        ticks = [low, high]
    return [(t, f"{t:.3g}") for t in ticks]


def _ticks_between(low: float, high: float, steps: Iterable[int]) -> list[float]:
    steps = tuple(steps)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    ticks = (float(f"{s}e{e}") for e in range(first, last + 1) for s in steps)
    return [t for t in ticks if low * (1 - 1e-9) <= t <= high * (1 + 1e-9)]


# ---------------------------------------------------------------- memorization study


def repetitions(point: Point, memo: dict, config: dict[str, Any]) -> float | None:
    """The first of ``REPETITION_KEYS`` in memorization.json, the overrides or the config."""
    for source in (memo, point.overrides, config):
        for key in REPETITION_KEYS:
            value = source.get(key)
            value = as_number(value) if isinstance(value, str) else number(value)
            if value is not None:
                return value
    return None


def memorization_rows(points: Sequence[Point]) -> list[dict]:
    """(loss, model, R, exact-match rate, validation loss, ...) of each point with a
    memorization.json; ``val_vs_standard``: its validation loss relative to the standard
    point of the same model and R."""
    rows = []
    for p in points:
        memo = read_json(JobPaths(p.job_dir).memorization) if p.job_dir else {}
        if not memo:
            continue
        config, record = job_config(p.job_dir), read_json(JobPaths(p.job_dir).record)
        k = int(config.get("train.goldfish.k") or 0)
        strategy = config.get("train.goldfish.strategy", "")
        width = config.get("train.goldfish.h")
        goldfish = [f"goldfish k={k}", strategy, f"h={width}" if width is not None else ""]
        params = number(record.get("n_params"))
        rows.append(
            {
                "num": p.num,
                "loss": "standard" if k == 0 else " ".join(part for part in goldfish if part),
                "model": record.get("model", config.get("model.name", "?"))
                + (f" ({params / 1e6:.3g}M)" if params else ""),
                "repetitions": repetitions(p, memo, config),
                "exact_match_rate": number(memo.get("exact_match_rate")),
                "token_match": number(memo.get("token_match")),
                "rouge_l": number(memo.get("rouge_l")),
                "val_loss": number((read_summary(p.job_dir) or {}).get("val_loss")),
            }
        )
    standard = {
        (r["model"], r["repetitions"]): r["val_loss"] for r in rows if r["loss"] == "standard"
    }
    for r in rows:
        base = standard.get((r["model"], r["repetitions"]))
        ok = r["val_loss"] is not None and base and r["loss"] != "standard"
        r["val_vs_standard"] = r["val_loss"] / base - 1 if ok else None
    return rows


def memorization_section(points: Sequence[Point], out: Path) -> list[str]:
    rows = memorization_rows(points)
    if not rows:
        return []
    lines = ["", "## Memorization", ""]
    lines += table(
        [
            "#",
            "loss",
            "model",
            "R",
            "exact match",
            "token match",
            "ROUGE-L",
            "val loss",
            "val loss vs standard",
        ],  # fmt: skip
        [
            (
                r["num"],
                r["loss"],
                r["model"],
                fmt(r["repetitions"]),
                fmt(r["exact_match_rate"], "{:.3f}"),
                fmt(r["token_match"], "{:.3f}"),
                fmt(r["rouge_l"], "{:.3f}"),
                fmt(r["val_loss"], "{:.3f}"),
                fmt(r["val_vs_standard"], "{:+.1%}"),
            )
            for r in rows
        ],
    )
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r["repetitions"] is not None and r["exact_match_rate"] is not None:
            groups[f"{r['loss']}, {r['model']}"].append((r["repetitions"], r["exact_match_rate"]))
    if not groups:
        return lines + ["", f"(no repetition count found: set one of {', '.join(REPETITION_KEYS)})"]
    series = [(label, *zip(*sorted(pairs))) for label, pairs in sorted(groups.items())]
    path = plot(
        out / "memorization.png",
        series,
        xlabel="repetitions R",
        ylabel="exact-match rate",
        title="memorization against repetitions",
        logx=True,
        dashed="goldfish",
    )
    return lines + ["", f"![memorization]({path.name})"]


# --------------------------------------------------------------------- plan vs measured


def job_dirs(path: Path) -> list[Path]:
    if JobPaths(path).record.is_file():
        return [path]
    return [p.job_dir for p in read_sweep(path) if p.job_dir is not None]


def plan_section(plan_file: Path, path: Path, out: Path) -> list[str]:
    """Predicted against measured step time for jobs whose model, machine and grid match."""
    plan = read_json(plan_file)
    if not isinstance(plan.get("plans"), list):
        raise ReportError(
            f"--plan {plan_file}: not a planner JSON (python -m axonn_launch.plan ... output=json)"
        )
    predicted = {json.dumps(r["grid"], sort_keys=True): r["step_time_s"] for r in plan["plans"]}
    pairs = []
    for job in job_dirs(path):
        record = read_json(JobPaths(job).record)
        measured = number((read_summary(job) or {}).get("step_time_s"))
        grid = json.dumps(record.get("grid"), sort_keys=True)
        same = record.get("model") == plan.get("model") and record.get("machine") == plan.get(
            "machine"
        )
        if same and measured is not None and grid in predicted:
            pairs.append((grid, predicted[grid], measured))
    lines = ["", "## Planner: predicted against measured step time", ""]
    if not pairs:
        return lines + [
            f"(no job here matches a plan of {plan.get('model')} on {plan.get('machine')})"
        ]
    lines += table(
        ["grid", "predicted s", "measured s", "measured / predicted"],
        [(g, fmt(p, "{:.3g}"), fmt(m, "{:.3g}"), fmt(m / p, "{:.2f}")) for g, p, m in pairs],
    )
    path_png = plot(
        out / "plan.png",
        [("jobs", [p for _, p, _ in pairs], [m for _, _, m in pairs])],
        xlabel="predicted step time s",
        ylabel="measured step time s",
        title="planner against measurement",
        points=True,
        diagonal=True,
    )
    return lines + ["", f"![plan]({path_png.name})"]


# ----------------------------------------------------------------------------- CLI


_Parser = raising_parser(ReportError)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m axonn_launch.report",
        description="Plots and report.md for a job dir, a sweep dir or a memorization study.",
        epilog="example: python -m axonn_launch.report jobs/sweeps/2026-12-01_10-00-00"
        " --metric tokens_per_s",
    )
    parser.add_argument("path", type=Path, help="a job directory or a sweep directory")
    parser.add_argument(
        "--out", type=Path, help="where report.md and the PNGs go (default PATH/report)"
    )
    parser.add_argument(
        "--metric",
        help=f"sweeps: one of {', '.join(METRICS)} (default: tokens_per_s for a sweep over"
        " grid, nodes or other keys of how jobs run; else val_loss, or final_loss without it)",
    )
    parser.add_argument(
        "--plan", type=Path, help="planner JSON to compare with measured step times"
    )
    parser.add_argument("--debug", action="store_true", help="a traceback instead of one line")
    return parser.parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.metric is not None and args.metric not in METRICS:
        raise ReportError(f"--metric={args.metric}: valid: {', '.join(METRICS)}")
    path, out = args.path, args.out or args.path / "report"
    if JobPaths(path).record.is_file():
        kind = "job"
    elif (path / "points").is_dir():
        kind = "sweep"
    else:
        raise ReportError(
            f"{path}: neither a job directory (job.json) nor a sweep directory (points/)"
        )
    refuse_dry_run(path, kind)
    pyplot()  # a missing matplotlib is reported before anything is written
    out.mkdir(parents=True, exist_ok=True)
    lines = job_report(path, out) if kind == "job" else sweep_report(path, out, args.metric)
    if args.plan:
        lines += plan_section(args.plan, path, out)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'report.md'} and {len(list(out.glob('*.png')))} images")
    return 0


def refuse_dry_run(path: Path, kind: str) -> None:
    """A dry run (a job, or a sweep whose every point is one) has nothing to report."""
    if kind == "job":
        problem = dry_run_problem(path)
    else:
        points = read_sweep(path)
        dry = points and all(p.status == DRY_RUN_STATUS for p in points)
        problem = f"{path}: {DRY_RUN_WORDS}" if dry else None
    if problem:
        raise ReportError(problem)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_tool(_main, argv, (ReportError,))


if __name__ == "__main__":
    sys.exit(main())
