"""``python -m axonn_launch.plan``: the planner's ranking of grids (``cost/planner.py``).

CLI (login node, no torch):
    python -m axonn_launch.plan machine=frontier model=gpt_320b nodes=1024 top=5 \
        [train.global_batch=2048] [train.micro_batch=8] [calibration=cal.json] [output=json]
Everything but ``top``, ``output`` and ``calibration`` is a Hydra override, composed as the
launcher composes it (``--config-dir DIR`` too: a site's conf directory, as the
launcher's): ``machine.hardware.*``, ``model.*`` and ``train.*`` can be changed too.
``calibration=`` is a file from ``axonn_launch.calibrate``. Below the table: the best
grid's checkpoint interval (``train.checkpoint_every=auto``, Young/Daly) and expected
goodput (``cost/expected_goodput.py``), also under ``checkpointing`` in ``output=json``; on
a Slurm machine, the spare nodes' node-hours next to the goodput with and without them
(``recovery.spare_nodes``, ``queue_wait_h=``), under ``spares``.
"""

from __future__ import annotations

import os
import sys

from axonn_launch.config.compose import machine_choices
from axonn_launch.cost.perf import (
    profile_calibration,
)
from axonn_launch.cost.plan_report import (
    PlanArgs,
    plan_report,
    positive_int,
    read_calibration,
    spares_of,
)
from axonn_launch.cost.planner import (
    PlanError,
)
from axonn_launch.usage import help_page, run_tool, wants_help

# --------------------------------------------------------------------------- CLI

PLAN_KEYS = ("top", "output", "calibration", "queue_wait_h")


def help_text() -> str:
    """``plan --help``; its machine list is the profiles in conf/machine/."""
    return help_page(
        usage="python -m axonn_launch.plan [KEY=VALUE ...] [--config-dir DIR] [--debug]",
        summary=SUMMARY,
        keys=[("machine=NAME", machine_choices()), *KEYS],
        examples=EXAMPLES,
    )


SUMMARY = (
    "Enumerate every 4D grid (data, x, y, z) of a node count that divides the model and the\n"
    "batch and fits in memory, predict each one's step time and print the fastest. The\n"
    "configuration is composed exactly as the launcher composes it."
)
KEYS = [
    ("model=NAME", "gpt_tiny (default) ... gpt_640b, llama_tiny ... llama3_405b"),
    ("nodes=N", "node count to plan for; default: the fewest where a grid fits"),
    ("top=K", "how many grids to print (default 5)"),
    ("output=table|json", "aligned columns (default) or JSON"),
    ("calibration=FILE", "measurements from python -m axonn_launch.calibrate"),
    ("queue_wait_h=H", "hours a new job waits after a failure (default 1): what spares save"),
    ("recovery.spare_nodes=K", "spare nodes whose node-hours and goodput plan shows"),
    ("train.KEY=VALUE", "any training key: global_batch, seq_len, micro_batch (pins it)"),
    ("machine.hardware.KEY=VALUE", "any hardware number, e.g. inter_node_gbps=50"),
    ("--config-dir DIR", "a site's conf directory (machine/NAME.yaml), as the launcher's"),
    ("--debug", "show the traceback of an error"),
]
EXAMPLES = [
    "python -m axonn_launch.plan machine=frontier model=gpt_320b nodes=1024 top=5",
    "python -m axonn_launch.plan machine=frontier model=gpt_320b      # the fewest nodes",
    "python -m axonn_launch.plan machine=alps model=gpt_80b nodes=1536 output=json",
]


def parse_args(argv: list[str]) -> PlanArgs:
    """``top=``, ``output=`` and ``calibration=`` are the planner's own; everything else is
    a Hydra override composed exactly as the launcher composes it."""
    from axonn_launch.config.compose import ConfigError, account_override, load

    own: dict[str, str] = {}
    overrides: list[str] = []
    for arg in with_config_dir(argv):
        key, sep, value = arg.partition("=")
        if not sep:
            raise PlanError(f"{arg!r}: expected key=value (python -m axonn_launch.plan --help)")
        if key in PLAN_KEYS:
            own[key] = value
        else:
            overrides.append(arg)
    try:
        cfg = load(overrides)
    except ConfigError as exc:
        raise PlanError(str(exc)) from exc
    output = own.get("output", "table")
    if output not in ("table", "json"):
        raise PlanError(f"output={output!r}; valid: table, json")
    return PlanArgs(
        machine=cfg.machine,
        model=cfg.model,
        train=cfg.train,
        nodes=None if cfg.nodes is None else positive_int("nodes", str(cfg.nodes)),
        top=positive_int("top", own.get("top", "5")),
        output=output,
        calibration=read_calibration(own["calibration"], profile_calibration(cfg.machine.hardware))
        if own.get("calibration")
        else None,
        overrides=tuple(overrides),
        spares=spares_of(cfg, own.get("queue_wait_h")),
        account_key=account_override(cfg.site, cfg.machine.name),
    )


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def with_config_dir(argv: list[str]) -> list[str]:
    """``argv`` with ``--config-dir DIR`` (``-cd DIR``, ``--config-dir=DIR``) as the override
    it stands for in the launcher (``cli.check_arguments``): a site's conf directory on
    Hydra's search path, after the package's ``conf/`` (docs/site.md)."""
    args, folder = [], None
    pairs = iter(argv)
    for arg in pairs:
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            folder = value if eq else next(pairs, "")
        else:
            args.append(arg)
    if folder is None:
        return args
    if not folder or not os.path.isdir(folder):
        raise PlanError(
            f"--config-dir={folder!r}: not a directory; valid: a site's conf directory"
            " holding machine/<name>.yaml (docs/site.md)"
        )
    return [*args, f"hydra.searchpath=[file://{os.path.abspath(folder)}]"]


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit status 0 with plans, 1 when no grid can run, 2 on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(help_text())
        return 0
    return run_tool(_main, argv, (PlanError, ValueError, TypeError))


def _main(argv: list[str]) -> int:
    text, found = plan_report(parse_args(argv))
    print(text)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
