"""What a rehearsal (``rehearse=true``) validates: the site's configuration, on the local
cluster's nodes with this computer's interpreter (``site_config``). ``resolve.resolve``
resolves it; ``submit/rehearse.py`` runs it. Never imports torch.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from axonn_launch import scheduler
from axonn_launch.common.rules import or_list
from axonn_launch.config.compose import ConfigError, LaunchConfig, machine_names, machine_profile

LOCAL_MACHINE = "slurm_local"
NODES = 2  # the local cluster's nodes a rehearsal runs on, unless nodes=1 asks for one
# every rank of a rehearsal runs on this computer's CPUs: gpt_small (~30 M) is the largest
# preset that trains there in reasonable time and memory on 16 ranks
MAX_PARAMS = 50_000_000


def check_machine(cfg: LaunchConfig) -> None:
    """Only a site's Slurm machine can be rehearsed."""
    machine = cfg.machine
    if not scheduler.of(machine).queued or machine.name == LOCAL_MACHINE:
        raise ConfigError(
            f"rehearse=true: machine={machine.name} already runs here; rehearse a site"
            f" machine: machine={or_list(site_machines())}"
        )


def site_machines() -> list[str]:
    """The machines a rehearsal can stand in for: the Slurm profiles but the local one."""
    return [name for name in machine_names("slurm") if name != LOCAL_MACHINE]


def site_config(cfg: LaunchConfig, login_python: str = sys.executable) -> LaunchConfig:
    """The configuration the rehearsal validates and runs: the site's, on two nodes (or one), with
    this computer's interpreter (``machine.python``) and no site account to ask for."""
    check_machine(cfg)
    params = cfg.model.n_params()
    if params > MAX_PARAMS:
        raise ConfigError(
            f"model={cfg.model.name} ({params / 1e6:,.0f} M parameters): a rehearsal runs every"
            f" rank on this computer's CPUs, up to {MAX_PARAMS / 1e6:.0f} M parameters; rehearse"
            " a small model of the same architecture (model=gpt_tiny or llama_tiny) with the"
            " grid shape you plan"
        )
    nodes = rehearsal_nodes(cfg)
    required = [key for key in cfg.machine.required if key != "slurm.account"]
    local = machine_profile(LOCAL_MACHINE).broadcast  # node-local storage: the local nodes'
    broadcast = replace(cfg.machine.broadcast, dir=local.dir, constraint="")
    machine = replace(cfg.machine, python=login_python, required=required, broadcast=broadcast)
    wait = True if cfg.wait is None else cfg.wait  # a rehearsal is followed to its end
    return replace(cfg, nodes=nodes, machine=machine, wait=wait)


def rehearsal_nodes(cfg: LaunchConfig) -> int:
    """The local nodes a rehearsal runs on: ``NODES``, or one where ``nodes=1`` asks (the
    site's script on one node: half the ranks, no inter-node step)."""
    if cfg.nodes not in (None, 1, NODES):
        raise ConfigError(
            f"nodes={cfg.nodes}: a rehearsal runs on the local cluster's {NODES} nodes or"
            f" on one; leave nodes unset ({NODES}) or set nodes=1"
        )
    return cfg.nodes or NODES


def what_resolves(cfg: LaunchConfig) -> LaunchConfig:
    """What a launch of ``cfg`` checks and resolves (``resolve.resolve``): a rehearsal's
    ``site_config``, else ``cfg`` itself."""
    return site_config(cfg) if cfg.rehearse else cfg
