"""The machine lists of help texts and messages are the profiles in conf/machine/, not
lists written by hand."""

from __future__ import annotations

from axonn_launch import plan
from axonn_launch.config.compose import machine_names
from axonn_launch.submit import rehearse
from tests.conftest import REPO

PROFILES = {path.stem for path in (REPO / "axonn_launch" / "conf" / "machine").glob("*.yaml")}


def test_plan_help_names_every_profile():
    line = next(ln for ln in plan.help_text().splitlines() if "machine=NAME" in ln)
    listed = line.split("machine=NAME", 1)[1].replace("(default)", "").replace(",", " ").split()
    assert set(listed) == PROFILES and listed[0] == "local"


def test_a_rehearsal_names_the_slurm_profiles_of_sites():
    assert set(machine_names()) == PROFILES
    assert set(rehearse.site_machines()) == set(machine_names("slurm")) - {"slurm_local"}
    assert "local" not in rehearse.site_machines()
