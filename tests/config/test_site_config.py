"""Values only the user knows come from a site file or the command line."""

from tests.conftest import run_launcher

SITE = "# @package _global_\nsite:\n  accounts:\n    frontier: CSC999\n"


def test_site_file_from_config_dir_supplies_the_account(tmp_path):
    (tmp_path / "site" / "local").mkdir(parents=True)
    (tmp_path / "site" / "local" / "default.yaml").write_text(SITE)
    job = tmp_path / "job"
    args = [
        "--config-dir",
        str(tmp_path / "site"),
        "machine=frontier",
        "model=gpt_5b",
        "train.data=synthetic",
        "grid.x=8",
        "train.steps=100",  # fits its allocations: no wall-clock warning
        "train.warmup_steps=10",  # within the run: no warm-up warning
        "dry_run=true",
        f"hydra.run.dir={job}",
    ]
    result = run_launcher(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --account=CSC999" in (job / "submission.sh").read_text()
    assert "warning" not in result.stderr


def test_dry_run_without_account_renders_a_placeholder_and_warns(tmp_path):
    job = tmp_path / "job"
    result = run_launcher(
        [
            "machine=alps",
            "model=gpt_5b",
            "train.data=synthetic",
            "grid.x=4",
            "dry_run=true",
            f"hydra.run.dir={job}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --account='<REQUIRED:machine.slurm.account>'" in result.stdout
    assert result.stderr.startswith("warning: machine.slurm.account is not set")


def test_command_line_account_wins(tmp_path):
    job = tmp_path / "job"
    result = run_launcher(
        [
            "machine=perlmutter",
            "model=gpt_5b",
            "grid.x=4",
            "dry_run=true",
            "machine.slurm.account=m42_g",
            f"hydra.run.dir={job}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --account=m42_g" in (job / "submission.sh").read_text()
