"""Site facts as data: every flag and variable of a site profile cites where it comes from.

A profile's ``sources`` maps each fact it sets to a page or file (``MachineProfile.sources``):
``env.NAME``, ``multinode_env.NAME``, ``task_env.NAME``; ``slurm.FIELD`` for each Slurm
setting the profile changes from ``SlurmSettings``' default (``slurm.extra_sbatch.KEY`` for
extra flags); ``srun_args[ARG]`` with ARG as the composed profile has it (interpolations
resolved, as in the batch script); ``modules``; ``setup[N]`` (1-based); ``container.FIELD``;
``broadcast.FIELD`` and ``reliability.FIELD`` (failure rate, write bandwidth) where set;
``hardware.FIELD`` for the planner's peak, memory bandwidth, GEMM efficiency and bus table.
Keys the profile lists in ``required`` (the user's own, e.g. the account) need none.
A citation starts with a URL or ``owner/repo:path``; a note may follow.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from axonn_launch.common.machine import (
    Broadcast,
    Container,
    Hardware,
    MachineProfile,
    Reliability,
    SlurmSettings,
)
from axonn_launch.config.compose import load
from axonn_launch.submit.render import setup_lines

SITES = ("perlmutter", "frontier", "alps", "lumi")
CITATION = re.compile(r"^(https?://\S+|[\w.-]+/[\w.-]+:\S+)")
ENV_GROUPS = ("env", "multinode_env", "task_env")
# the planner's inputs that a profile cites (plan prints them with their sources)
PLANNER_FACTS = {
    "hardware.peak_tflops_per_gpu",
    "hardware.memory_gbps",
    "hardware.gemm_efficiency",
    "hardware.bus_gbps",
}


@pytest.fixture(scope="module")
def profiles() -> dict[str, MachineProfile]:
    """Each site profile as the launcher composes it (its account is the user's)."""
    return {site: load([f"machine={site}", f"site.accounts.{site}=acct"]).machine for site in SITES}


def changed_fields(value: object, default: object, prefix: str) -> set[str]:
    """``prefix.FIELD`` for each dataclass field of ``value`` that differs from ``default``."""
    return {
        f"{prefix}.{f.name}"
        for f in dataclasses.fields(value)
        if getattr(value, f.name) != getattr(default, f.name)
    }


def facts(machine: MachineProfile) -> set[str]:
    """The source keys the profile must have: one per flag and variable it sets."""
    keys = {f"{group}.{name}" for group in ENV_GROUPS for name in getattr(machine, group)}
    slurm = machine.slurm
    keys |= changed_fields(slurm, SlurmSettings(), "slurm") - {
        "slurm.srun_args",
        "slurm.extra_sbatch",
    }
    keys |= {f"slurm.extra_sbatch.{key}" for key in slurm.extra_sbatch}
    keys |= {f"srun_args[{arg}]" for arg in slurm.srun_args}
    keys |= {"modules"} if machine.modules else set()
    keys |= {f"setup[{n}]" for n in range(1, len(machine.setup) + 1)}
    keys |= changed_fields(machine.container, Container(), "container")
    keys |= changed_fields(machine.broadcast, Broadcast(), "broadcast")
    keys |= changed_fields(machine.reliability, Reliability(), "reliability")
    keys |= changed_fields(machine.hardware, Hardware(), "hardware") & PLANNER_FACTS
    return keys - set(machine.required)


def uncited(machine: MachineProfile) -> list[str]:
    """Facts without a citation that starts with a URL or owner/repo:path."""
    return sorted(k for k in facts(machine) if not CITATION.match(machine.sources.get(k, "")))


def stale(machine: MachineProfile) -> list[str]:
    """Citations of things the profile does not set."""
    return sorted(set(machine.sources) - facts(machine))


@pytest.mark.parametrize("site", SITES)
def test_every_flag_and_variable_is_cited(profiles, site):
    missing = uncited(profiles[site])
    assert not missing, f"machine={site}: no citation (URL or owner/repo:path) for {missing}"


@pytest.mark.parametrize("site", SITES)
def test_no_citation_names_a_thing_the_profile_does_not_set(profiles, site):
    extra = stale(profiles[site])
    assert not extra, f"machine={site}: sources cites what the profile does not set: {extra}"


def test_a_new_uncited_flag_or_variable_is_caught(profiles):
    """The checks above see additions in each kind of fact, and a removal's leftover."""
    machine = profiles["frontier"]
    slurm = dataclasses.replace(
        machine.slurm,
        qos="debug",
        srun_args=[*machine.slurm.srun_args, "--exact"],
        extra_sbatch={"core-spec": "0"},
    )
    added = dataclasses.replace(
        machine,
        slurm=slurm,
        env={**machine.env, "NEW_VARIABLE": "1"},
        setup=[*machine.setup, "ulimit -c 0"],
    )
    assert uncited(added) == [
        "env.NEW_VARIABLE",
        "setup[2]",
        "slurm.extra_sbatch.core-spec",
        "slurm.qos",
        "srun_args[--exact]",
    ]
    env = {k: v for k, v in machine.env.items() if k != "OMP_NUM_THREADS"}
    assert stale(dataclasses.replace(machine, env=env)) == ["env.OMP_NUM_THREADS"]


def test_perlmutter_sets_hpe_and_cscs_libfabric_settings(profiles):
    env = profiles["perlmutter"].env
    expected = {
        "FI_CXI_DEFAULT_CQ_SIZE": "131072",
        "FI_CXI_DEFAULT_TX_SIZE": "2048",
        "FI_CXI_RX_MATCH_MODE": "hybrid",
        "FI_CXI_RDZV_GET_MIN": "0",
        "FI_CXI_RDZV_THRESHOLD": "0",
        "FI_CXI_RDZV_EAGER_SIZE": "0",
        "OMP_NUM_THREADS": "16",
    }
    assert {k: env.get(k) for k in expected} == expected


def test_perlmutter_disables_ll128_only_across_nodes(profiles):
    machine = profiles["perlmutter"]
    one_node = setup_lines(machine=machine, nodes=1)
    two_nodes = setup_lines(machine=machine, nodes=2)
    assert not [line for line in one_node if "NCCL_PROTO" in line]
    assert "export NCCL_PROTO='^LL128'" in two_nodes
