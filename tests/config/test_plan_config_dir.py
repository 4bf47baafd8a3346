"""``plan --config-dir DIR``: a site's conf directory, as the launcher's Hydra flag takes it."""

from __future__ import annotations

from tests.cli_server import run_module
from tests.conftest import REPO


def test_plan_takes_a_sites_config_dir_as_the_launcher_does(tmp_path):
    """A machine only the site directory has is planned, and the ready-to-run command keeps
    the directory; a flag naming no directory is one line, exit code 2."""
    site = tmp_path / "site"
    (site / "machine").mkdir(parents=True)
    packaged = (REPO / "axonn_launch" / "conf" / "machine" / "slurm_local.yaml").read_text()
    (site / "machine" / "sitebox.yaml").write_text(
        packaged.replace("name: slurm_local", "name: sitebox")
    )
    planned = run_module("axonn_launch.plan", ["--config-dir", str(site), "machine=sitebox"],
                         cwd=tmp_path)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    command = [ln for ln in planned.stdout.splitlines() if "python -m axonn_launch " in ln]
    assert command and "machine=sitebox" in command[-1]
    assert f"hydra.searchpath=[file://{site}]" in command[-1], command[-1]
    missing = run_module("axonn_launch.plan", [f"--config-dir={tmp_path / 'none'}"], cwd=tmp_path)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().splitlines()[-1] == (
        f"error: --config-dir={str(tmp_path / 'none')!r}: not a directory; valid: a site's"
        " conf directory holding machine/<name>.yaml (docs/site.md)"
    )
