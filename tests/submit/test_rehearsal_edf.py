"""A rehearsal of a container machine needs its EDF: with none in the search path it uses
the project's own (``machines/<machine>/``, the file users copy to ``~/.edf``) and says
so, instead of refusing; a real submission still needs it in place."""

from __future__ import annotations

from tests.conftest import REPO, run_launcher

ALPS_EDF = REPO / "machines" / "alps" / "axonn.toml"


def test_a_rehearsal_without_an_edf_uses_the_projects_and_says_so(tmp_path):
    job_dir = tmp_path / "job"
    args = ["machine=alps", "model=llama_tiny", "rehearse=true", "grid.x=2", "grid.y=2",
            "grid.z=2", "dry_run=true", f"hydra.run.dir={job_dir}"]  # fmt: skip
    empty = {"HOME": str(tmp_path), "EDF_PATH": ""}  # no ~/.edf, no EDF_PATH
    result = run_launcher(args, cwd=tmp_path, env=empty)
    assert result.returncode == 0, result.stderr[-2000:]
    (warning,) = [ln for ln in result.stderr.splitlines() if "EDF search path" in ln]
    assert f"this rehearsal uses the project's own {ALPS_EDF}" in warning
    assert f"mkdir -p ~/.edf && cp {ALPS_EDF} ~/.edf/" in warning
    assert f"its EDF {ALPS_EDF} was read" in result.stdout
