"""The package's start-up model (axonn_launch/conf/startup.yaml) made from the start-up
bench's fits (bench/results/scale.json, ``bench/scale/run.py``), so that a new measurement
gives a new model with no hand refit.

    python bench/scale/startup_model.py            # write conf/startup.yaml from scale.json
    python bench/scale/startup_model.py --check    # exit 1 when the committed file differs

Each phase of the model is the best fit of one measured phase (``fit.py``), with one rule
of its own: the unpack runs on every node at once on a real machine, but the emulated
nodes queue theirs on the host's cores, so the model counts one node's unpack, the fit's
intercept plus one slope per host core (docs/guide/at-scale.md, "Start-up and restart").
No torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCALE = REPO / "bench" / "results" / "scale.json"
MODEL = REPO / "axonn_launch" / "conf" / "startup.yaml"
# the model's phase <- the bench's phase, and whether it is counted only with a broadcast
PHASES = {
    "batch_start": ("sbatch_to_batch_start", False),
    "broadcast_pack": ("broadcast_pack", True),
    "broadcast_sbcast": ("broadcast_sbcast", True),
    "broadcast_unpack": ("broadcast_unpack", True),
    "srun_fanout": ("srun_fanout_last_task", False),
}
PER_NODE = "broadcast_unpack"  # done on every node at once at a site (module docstring)
WORDS = {
    "batch_start": "sbatch to the batch script's start",
    "broadcast_pack": "the environment packed once on the batch node",
    "broadcast_sbcast": "sbcast of the pack to every node",
    "broadcast_unpack": "the pack unpacked on every node, one task per node",
    "srun_fanout": "srun's start to the last of N x 8 tasks started",
}
HEADER = """\
# The start-up model: seconds from sbatch to the last task started, per phase, against the job's
# node count N. Read on the login node by axonn_launch/cost/startup.py for the launch summary's
# restart time and expected goodput and for plan (docs/guide/at-scale.md, "Start-up and restart").
# A machine profile's reliability.startup (same keys) replaces it: a site measures its own;
# an explicit reliability.restart_s wins over both.
#
# Each phase: seconds = a + b * f(N), f by form: constant 0, linear N, n_log_n N log2 N,
# quadratic N^2 (never below 0). broadcast: true = counted only when the job copies its
# environment to node-local storage (machine.python_broadcast).
#
# Made by bench/scale/startup_model.py from the best least-squares fit of each phase in
# bench/results/scale.json, made by `{command}`
# ({when}, {host}).
# The Frontier profile's real batch script on emulated nodes (one slurmd each) of one host,
# 8 tasks per node. Every node shares the host's cores, so the per-node phases are upper
# bounds on a site's time, not a site's time. Not in it: the torch import, the rendezvous,
# NCCL/RCCL init, the model's init (plan's "job start" line).
"""


def number(x: float) -> str:
    return f"{x:.4g}"


def host_cores(host: str) -> int:
    """The cores of the bench's host, from its "<name> <N> CPUs"."""
    found = re.search(r"(\d+) CPUs", host)
    if not found:
        raise ValueError(f"scale.json host {host!r}: no 'N CPUs' in it")
    return int(found.group(1))


def phase_lines(name: str, fit: dict, broadcast: bool, cores: int) -> list[str]:
    """One phase's YAML lines, with a comment saying where it came from."""
    best = fit["best"]
    chosen = fit["fits"][best]
    rms = chosen["rms_residual_s"]
    form, a, b = best, chosen["a"], chosen["b"]
    if best == "constant":
        note = f"{WORDS[name]}; no growth measured: the mean (RMS {rms:.2g} s)"
    else:
        note = f"{WORDS[name]} (the {best} fit, RMS {rms:.2g} s)"
    if name == PER_NODE:
        one = a + cores * b
        note = (
            f"{WORDS[name]}: per-node work, done on every node at once at a site. Emulated, the"
            f" N unpacks queued on the host's {cores} cores, so the {best} fit's slope"
            f" ({number(b)} s per node, RMS {rms:.2g} s) is that queue, not growth: one node's"
            f" unpack is the intercept plus one slope per host core, {number(a)} + {cores} x"
            f" {number(b)} = {number(one)} s"
        )
        form, a, b = "constant", one, 0.0
    lines = [f"  {name}:", *wrapped(note), f"    form: {form}", f"    a: {number(a)}"]
    if form != "constant":
        lines.append(f"    b: {number(b)}")
    if broadcast:
        lines.append("    broadcast: true")
    return lines


def wrapped(text: str, width: int = 96) -> list[str]:
    """``text`` as comment lines of the phase."""
    lines, line = [], "    #"
    for word in text.split():
        if len(line) + 1 + len(word) > width:
            lines.append(line)
            line = "    #"
        line += " " + word
    return [*lines, line]


def model_text(scale: dict) -> str:
    """conf/startup.yaml's text for the bench's results ``scale``."""
    cores = host_cores(scale["host"])
    nodes = sorted(p["nodes"] for p in scale["points"] if "error" not in p)
    source = (
        f"bench/results/scale.json (bench/scale/run.py, {scale['when']}): the Frontier"
        f" profile's batch script on {nodes[0]}-{nodes[-1]} emulated nodes of one"
        f" {cores}-core host"
    )
    lines = [
        HEADER.format(command=scale["command"], when=scale["when"], host=scale["host"]).rstrip(),
        "label: emulated",
        f"nodes: {json.dumps(nodes).replace(',', ', ').replace(',  ', ', ')}",
        f"source: {json.dumps(source)}",
        "phases:",
    ]
    for name, (measured, broadcast) in PHASES.items():
        lines += phase_lines(name, scale["fits"][measured], broadcast, cores)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=Path, default=SCALE)
    parser.add_argument("--out", type=Path, default=MODEL)
    parser.add_argument("--check", action="store_true",
                        help="write nothing: exit 1 when --out is not its text")  # fmt: skip
    args = parser.parse_args(argv)
    text = model_text(json.loads(args.scale.read_text()))
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from ' + str(args.scale)}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
