"""The job's start-up against its node count, and the restart it puts in the goodput.

Torch-free, on the login node: the launch summary's restart time and expected goodput
(``cost/expected_goodput.py``) and ``plan`` use it. The model is phases of the batch
script's start-up, each ``a + b * f(N)`` (``common/machine.StartupPhase``), read from the
package's ``conf/startup.yaml`` (fits of ``bench/results/scale.json``: emulated nodes), or
from the machine profile's ``reliability.startup`` where a site measured its own. An
explicit ``reliability.restart_s`` is the whole restart and wins over both.

How it is computed and its source: ``docs/guide/at-scale.md`` ("Start-up and restart").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import resources

from axonn_launch.common.durations import duration
from axonn_launch.common.machine import MachineProfile, StartupModel, StartupPhase

PACKAGED = "axonn_launch/conf/startup.yaml"
SHAPES = {
    "constant": lambda n: 0.0,
    "linear": lambda n: float(n),
    "n_log_n": lambda n: n * math.log2(n),
    "quadratic": lambda n: float(n * n),
}
# A failure's detection, before the start-up: a surviving rank waits out the job's collective
# timeout (600 s, train/parallel/bootstrap.py init_distributed) before it ends. A default
# stated as one, not a measurement; reliability.restart_s= replaces detection and start-up.
DETECT_S = 600.0


def phase_seconds(phase: StartupPhase, nodes: int) -> float:
    """``a + b * f(nodes)``, never below 0 (a fit's negative intercept at small N)."""
    return max(0.0, phase.a + phase.b * SHAPES[phase.form](nodes))


@functools.cache
def packaged() -> StartupModel:
    """The package's start-up model (``conf/startup.yaml``), read once."""
    import yaml

    raw = yaml.safe_load(resources.files("axonn_launch.conf").joinpath("startup.yaml").read_text())
    try:
        phases = {name: StartupPhase(**fields) for name, fields in raw.pop("phases").items()}
        return StartupModel(phases=phases, **raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{PACKAGED}: {exc}") from None


@dataclass(frozen=True)
class Startup:
    """The start-up of a job on ``nodes`` nodes: each counted phase's seconds."""

    nodes: int
    seconds: dict[str, float]  # phase -> seconds, the phases this job runs
    model: StartupModel
    site: bool  # the profile's own model (reliability.startup), else the package's

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def extrapolated(self) -> bool:
        return not min(self.model.nodes) <= self.nodes <= max(self.model.nodes)

    @property
    def label(self) -> str:
        """``extrapolated`` beyond the model's node counts, else the model's own label."""
        return "extrapolated" if self.extrapolated else self.model.label

    def basis(self) -> str:
        """``extrapolated from emulated runs of 8-512 nodes`` (or ``fitted to``, inside)."""
        low, high = min(self.model.nodes), max(self.model.nodes)
        runs = f"{low:,}-{high:,} nodes" if low < high else f"{low:,} nodes"
        how = "extrapolated from" if self.extrapolated else "fitted to"
        return f"{how} {self.model.label} runs of {runs}"

    def words(self) -> str:
        """``start-up 4.2 min at 1,024 nodes, extrapolated from emulated runs of 8-512 nodes``."""
        nodes = f"{self.nodes:,} node{'' if self.nodes == 1 else 's'}"
        return f"start-up {duration(self.total_s)} at {nodes}, {self.basis()}"

    def as_dict(self) -> dict:
        return {"nodes": self.nodes, "seconds": self.total_s, "phases": self.seconds,
                "label": self.label,
                "basis": self.basis(), "model_label": self.model.label,
                "model_nodes": self.model.nodes,
                "source": self.model.source if self.site else f"{PACKAGED}: {self.model.source}",
                "from": "machine.reliability.startup" if self.site else PACKAGED}  # fmt: skip


def startup(machine: MachineProfile, nodes: int) -> Startup:
    """The start-up of a job on ``nodes`` nodes of ``machine``; the broadcast's phases only
    where the job copies its environment (``MachineProfile.broadcasts``)."""
    site = machine.reliability.startup is not None
    model = machine.reliability.startup if site else packaged()
    counted = {name: phase_seconds(phase, nodes) for name, phase in model.phases.items()
               if not phase.broadcast or machine.broadcasts(nodes)}  # fmt: skip
    return Startup(nodes=nodes, seconds=counted, model=model, site=site)


@dataclass(frozen=True)
class Restart:
    """A failure to training again, besides reading the checkpoint back (R - δ)."""

    seconds: float
    startup: Startup | None  # None: reliability.restart_s as set
    detect_s: float = DETECT_S

    def words(self) -> str:
        """Where the restart's seconds come from, for the summary and ``plan``."""
        if self.startup is None:
            return "machine.reliability.restart_s as set: the start-up model not used"
        return f"detection {duration(self.detect_s)} + {self.startup.words()}"

    def as_dict(self) -> dict:
        if self.startup is None:
            return {"seconds": self.seconds, "from": "machine.reliability.restart_s"}
        return {"seconds": self.seconds, "from": "detection + start-up model",
                "detect_s": self.detect_s, "startup": self.startup.as_dict()}  # fmt: skip


def restart(machine: MachineProfile, nodes: int) -> Restart:
    """``reliability.restart_s`` where set, else detection plus the start-up at ``nodes``."""
    given = machine.reliability.restart_s
    if given is not None:
        return Restart(seconds=given, startup=None)
    up = startup(machine, nodes)
    return Restart(seconds=DETECT_S + up.total_s, startup=up)
