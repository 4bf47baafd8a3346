"""``metrics.*``: where a run's curves go besides ``metrics.jsonl``.

One dataclass for the login node and the job alike: the launcher builds it from the
composed config (``config/compose.py``) and the job reads it back from ``spec.json``, so
both refuse the same values, with one line naming the field. ``jsonl`` is always written;
``tensorboard`` is on by default; ``wandb`` is opt-in (``pip install -e '.[wandb]'``).
The sinks themselves are ``train/sinks.py``; the design is in docs/job-side.md ("Curves").
``train.profile`` (a torch.profiler window) is here too: ``train/health/profile.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SINKS = ("jsonl", "tensorboard")


@dataclass(frozen=True)
class MetricSink:
    """A ``metrics.sinks`` name and where the job finds its opener: ``opener`` is
    ``"module:function"``, a function of one ``train.sinks.SinkOpening`` that returns the
    open sink or None (imported only on rank 0 of a job that asks for it: no torch here).
    "" = nothing to open (``jsonl``, which ``train/metrics.py`` always writes)."""

    name: str
    opener: str


SINKS: dict[str, MetricSink] = {}


def register_sink(sink: MetricSink) -> MetricSink:
    """Add ``sink`` under its name, which no other may hold."""
    if not sink.name or sink.name in SINKS:
        raise ValueError(f"metric sink name {sink.name!r}: empty or already registered")
    SINKS[sink.name] = sink
    return sink


register_sink(MetricSink("jsonl", ""))
register_sink(MetricSink("tensorboard", "axonn_launch.train.sinks:open_tensorboard"))
register_sink(MetricSink("wandb", "axonn_launch.train.sinks:open_wandb"))
WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run: ``offline`` (compute nodes often have no internet) writes
    into the run's root dir, for ``wandb sync`` afterwards."""

    project: str = "axonn_launch"
    entity: str = ""  # "" = the logged-in user's default
    mode: str = "offline"  # online | offline
    group: str = ""  # "" = no group

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"metrics.wandb.mode={self.mode!r}: valid: {', '.join(WANDB_MODES)}")


@dataclass(frozen=True)
class MetricsConfig:
    sinks: list[str] = field(default_factory=lambda: list(DEFAULT_SINKS))
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        unknown = [name for name in self.sinks if name not in SINKS]
        if unknown:
            raise ValueError(
                f"metrics.sinks={list(self.sinks)!r}: unknown sink {unknown[0]!r};"
                f" valid: {', '.join(SINKS)}"
            )

    def wants(self, sink: str) -> bool:
        return sink in self.sinks

    @classmethod
    def from_dict(cls, raw: dict) -> MetricsConfig:
        return cls(sinks=list(raw.get("sinks", DEFAULT_SINKS)),
                   wandb=WandbConfig(**raw.get("wandb", {})))  # fmt: skip


@dataclass(frozen=True)
class ProfileConfig:
    """``train.profile.steps=a-b``: torch.profiler over optimizer steps a to b, a Chrome
    trace per rank in the job dir (``train/health/profile.py``); "" = off."""

    steps: str = ""
    # over the same window: a CUDA memory snapshot per rank on GPUs (also dumped on an
    # out-of-memory error), each rank's RSS and PSS on CPUs (train/health/profile.py)
    memory: bool = False

    def __post_init__(self) -> None:
        if self.steps and self.window() is None:
            raise ValueError(
                f"train.profile.steps={self.steps!r}: expected a-b, steps 1 <= a <= b"
                " (e.g. 3-4), or a single step, or '' (off)"
            )
        if self.memory and not self.steps:
            raise ValueError(
                "train.profile.memory=true: records over a window; set train.profile.steps=a-b"
                " too (e.g. 3-4), or train.profile.memory=false"
            )

    def window(self) -> tuple[int, int] | None:
        """(a, b), or None when off or malformed."""
        first, _, last = str(self.steps).partition("-")
        last = last or first
        if not (first.strip().isdigit() and last.strip().isdigit()):
            return None
        a, b = int(first), int(last)
        return (a, b) if 1 <= a <= b else None
