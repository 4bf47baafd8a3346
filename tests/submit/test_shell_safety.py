"""Config values never reach a shell unquoted: metacharacters in a job name or an
environment value are inert when the rendered script runs."""

import json
import subprocess

from tests.conftest import run_launcher

NAME = "x;$(touch pwned_name)`touch pwned_tick`'q\"z"
VALUE = "$(touch pwned_env); `touch pwned_env2` && echo 'a' \"b\""


def test_metacharacters_in_name_and_env_are_inert(tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    work = tmp_path / "cwd"
    work.mkdir()
    job_dir = tmp_path / "job"
    args = [
        "machine=slurm_local",
        "grid.x=2",
        "grid.z=2",
        "dry_run=true",
        f"name='{NAME.replace(chr(39), chr(92) + chr(39))}'",
        f"+machine.env.EVIL='{VALUE.replace(chr(39), chr(92) + chr(39))}'",
        f"hydra.run.dir={job_dir}",
    ]
    result = run_launcher(args, cwd=work, path_prefix=bindir)
    assert result.returncode == 0, result.stderr
    assert json.loads((job_dir / "job.json").read_text())["name"] == NAME
    script = (job_dir / "submission.sh").read_text()
    # Run the script's set-up section (everything before srun) in bash, then print the value.
    setup = script.split("# command")[0]
    probe = setup + '\nprintf "%s" "$EVIL"\n'
    run = subprocess.run(["bash", "-c", probe], cwd=work, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == VALUE
    # Running the whole script with stub srun: sbatch would read the #SBATCH lines as comments.
    subprocess.run(
        ["bash", str(job_dir / "submission.sh")],
        cwd=work,
        capture_output=True,
        env={"PATH": f"{bindir}:/usr/bin:/bin"},
    )
    assert not list(work.glob("pwned*")), "a metacharacter was executed"
    assert not list(tmp_path.glob("pwned*"))
    assert "--job-name=" in script and "pwned_name" in script  # present, but quoted


def test_a_failing_setup_line_is_reported_as_text_never_run_again(tmp_path, fake_sbatch):
    """The fail-fast message quotes the line; its `$(...)` is printed, not executed."""
    bindir, marker = fake_sbatch
    job_dir = tmp_path / "job"
    line = "false # $(touch pwned_msg) `touch pwned_msg2`"
    args = [
        "machine=slurm_local",
        "grid.x=2",
        "grid.z=2",
        "dry_run=true",
        f"+machine.setup=['{line}']",
        f"hydra.run.dir={job_dir}",
    ]
    result = run_launcher(args, cwd=tmp_path, path_prefix=bindir)
    assert result.returncode == 0, result.stderr
    script = job_dir / "submission.sh"
    run = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": f"{bindir}:/usr/bin:/bin"},
    )
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"axonn_launch: setup line 1 failed (exit 1): {line}; srun not started"
    )
    assert not list(tmp_path.glob("pwned*"))
    assert not marker.exists()  # srun (a recording stub here) never started
