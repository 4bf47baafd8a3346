"""The README's and the user guide's examples, all of them, run as written: docs that drift
from the product fail here.

Every line of every ```bash block of README.md and of the user guide's pages
(docs/guide/*.md, which hold what the README held before it became a short tour) is either
run or listed in NOT_RUN with the reason; a command found in more than one place runs once;
a new line that is neither fails ``test_every_readme_line_is_covered``. Lines run from
a temporary directory (job directories land there, not in the repository), as follows:

- launcher lines on a cluster machine (perlmutter, frontier, lumi, alps, slurm_local) get
  ``dry_run=true`` added: there is no such cluster here, and the real submission to the local
  Slurm cluster is tested in tests/slurm/test_launcher_on_slurm.py. A dry run still composes,
  validates, plans and renders everything, and a data path that is not on this computer
  (``/pscratch/tokens.bin``) only warns;
- ``machine=local`` launcher lines train for real, with ``train.steps=2`` added (the same code
  path as the 200 steps the README runs, in seconds); all but the bare default line also get
  ``train.sample_tokens=0`` (the sample after training is checked on that line), and the
  Optuna line runs 1 of its 8 trials (``hydra.sweeper.n_trials=1``: the same sweeper and
  code path; tests/submit/test_hydra_launchers.py runs an Optuna sweep of 3 trials);
- ``plan`` and ``jobs`` lines run exactly as written; the paths they name
  (``jobs/sweeps/<time>``, ``jobs/gpt_80b-frontier/<time>``) are first made there by dry runs;
- ``calibrate`` with local processes runs with fewer repetitions and smaller messages added
  (CALIBRATE_QUICK, the same code path), and ``calibrate machine=perlmutter``, which the
  README says to run inside an allocation, must stop here with its one-line error, exit 2;
- ``generate`` lines over a job dir run exactly as written, after a 2-step training of the
  default model into the job dir they name, with a ``p.jsonl`` of two short prompts; each
  must write one row per prompt. ``generate --help``'s examples are README lines.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.cli_server import run_module
from tests.conftest import REPO

README = REPO / "README.md"
GUIDE = sorted((REPO / "docs" / "guide").glob("*.md"))
DRY_RUN_MACHINES = {"perlmutter", "frontier", "lumi", "alps", "slurm_local"}
CALIBRATE_QUICK = [
    "reps=1",
    "warmup=1",
    f"small_bytes={1 << 10}",
    f"large_bytes={1 << 16}",
    "block_seconds=0.005",
]
QUICK_TRIALS = "hydra.sweeper.n_trials=1"
GENERATE_LLAMA = (
    "python -m axonn_launch.generate /models/Llama-3.2-1B prompts=p.jsonl out=o.jsonl"
    " machine=slurm_local grid.x=2 grid.z=2 wait=true"
)
NOT_RUN = {
    "bash machines/local/setup.sh && .venv/bin/python -m axonn_launch": (
        "installs the environment these tests run in (its second half is the README's"
        " `python -m axonn_launch`, which runs below)"
    ),
    "AXONN_START_SLURM=1 .venv/bin/python -m pytest": "runs this very test suite",
    "bash machines/slurm_local/start.sh": (
        "starts the local Slurm cluster (as root); .ci/run starts it before these tests"
    ),
    GENERATE_LLAMA: (
        "needs a 1B Llama the tests do not download; tests/commands/test_generate_cli.py runs an HF"
        " source (a tiny Llama built there) on a grid against transformers"
    ),
}
GENERATE_JOB = "jobs/gpt_tiny-local/2026-12-01_08-00-00"  # the job dir generate lines name
GENERATE_PROMPTS = [{"text": "ROMEO:"}, {"ids": [10, 65]}]  # short: 48 new tokens fit in 64
# paths the README's jobs lines name, made by a dry run of (overrides) before they run
NAMED_JOB_DIRS = {
    "jobs/sweeps/2026-11-29_10-00-00/0-gpt_tiny-slurm_local": ["machine=slurm_local"],
    "jobs/gpt_80b-frontier/2026-11-29_10-00-00": [
        "machine=frontier",
        "model=gpt_80b",
        "nodes=128",
        "grid=auto",
    ],
}


def readme_lines() -> list[str]:
    """Each command of the bash blocks of the README and the guide, continuation lines
    joined, each once (in the order first found)."""
    text = "".join(page.read_text() for page in [README, *GUIDE])
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(shlex.split(line, comments=True))
            if command and command not in lines:
                lines.append(command)
    return lines


LINES = readme_lines()
RUN = [line for line in LINES if line not in NOT_RUN]


def test_every_readme_line_is_covered():
    assert len(LINES) >= 15, "the README's bash blocks were not found"
    assert set(NOT_RUN) <= set(LINES), "NOT_RUN names a line the README no longer has"
    for line in RUN:
        words = line.split()
        assert words[:2] == ["python", "-m"] and words[2].startswith("axonn_launch"), (
            f"README line neither run nor in NOT_RUN: {line!r}"
        )


def command_for(line: str) -> tuple[list[str], int, str | tuple[str, ...]]:
    """(argv to run, expected exit code, text or texts the output must contain) for a README
    line."""
    module, *args = line.split()[2:]
    if module == "axonn_launch":
        keys = dict(a.partition("=")[::2] for a in args if "=" in a)
        if keys.get("machine", "local") in DRY_RUN_MACHINES:
            # a sweep's dry run prints each point's summary and the table, not the scripts
            shown = "sweep summary:" if "-m" in args else "--- batch script ---"
            return [module, *args, "dry_run=true"], 0, shown
        if not args:  # the default job, with its sample
            return [module, "train.steps=2"], 0, ("done: 2 steps", "--- sample (")
        args = [QUICK_TRIALS if a.startswith("hydra.sweeper.n_trials=") else a for a in args]
        return [module, *args, "train.steps=2", "train.sample_tokens=0"], 0, "done: 2 steps"
    if module == "axonn_launch.calibrate":
        if any(a.startswith("nproc=") for a in args):
            return [module, *args, *CALIBRATE_QUICK], 0, "written to jobs/calibrate-local/"
        return [module, *args], 2, "needs a GPU allocation (no srun task here)"
    if module == "axonn_launch.jobs":
        return [module, *args], 0, "skip" if args[0] == "resubmit" else "DRY_RUN"
    if module == "axonn_launch.generate":
        return [module, *args], 0, "next: head ./o.jsonl"
    return [module, *args], 0, "gpt_"  # plan: a table or JSON naming the model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory holding the job directories the README's jobs lines name."""
    root = tmp_path_factory.mktemp("readme")
    for job_dir, overrides in NAMED_JOB_DIRS.items():
        proc = run(["axonn_launch", *overrides, "dry_run=true", f"hydra.run.dir={job_dir}"], root)
        assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture(scope="module")
def generate_source(workspace: Path) -> Path:
    """The job dir the README's generate lines name, trained for 2 steps (a checkpoint at
    the end), and their p.jsonl; each generate line then writes o.jsonl there anew."""
    job = run(["axonn_launch", "train.steps=2", "train.sample_tokens=0", "train.eval_batches=0",
               f"hydra.run.dir={GENERATE_JOB}"], workspace)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    prompts = workspace / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in GENERATE_PROMPTS))
    return workspace / GENERATE_JOB


def generated_rows(workspace: Path) -> list[dict]:
    return [json.loads(x) for x in (workspace / "o.jsonl").read_text().splitlines()]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["EDF_PATH"] = str(REPO / "machines" / "alps")  # the EDF users copy to ~/.edf (Alps)
    return run_module(argv[0], argv[1:], cwd=cwd, env=env, timeout=300)


def _marks(line: str) -> list:
    argv, _, _ = command_for(line)
    slow = "train.steps=2" in argv or argv[0] in ("axonn_launch.calibrate", "axonn_launch.generate")
    return [pytest.mark.slow] if slow else []


@pytest.mark.parametrize("line", [pytest.param(x, marks=_marks(x)) for x in RUN], ids=RUN)
def test_readme_line_runs(line: str, workspace: Path, request):
    argv, code, expected = command_for(line)
    if argv[0] == "axonn_launch.generate":
        request.getfixturevalue("generate_source")
    proc = run(argv, workspace)
    output = proc.stdout + proc.stderr
    assert proc.returncode == code, f"{' '.join(argv)} exited {proc.returncode}:\n{output[-3000:]}"
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in output, output[-3000:]
    assert "Traceback" not in output
    if code:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if "output=json" in argv or "--json" in argv:
        json.loads(proc.stdout)
    if argv[0] == "axonn_launch.generate":  # one row per prompt, max_new_tokens each (no EOS)
        rows = generated_rows(workspace)
        new = int(dict(a.partition("=")[::2] for a in argv if "=" in a).get("max_new_tokens", 32))
        assert [len(r["output_ids"]) for r in rows] == [new] * len(GENERATE_PROMPTS), rows


def test_generate_help_examples_are_readme_lines():
    """What ``generate --help`` shows is what the README runs (or names in NOT_RUN)."""
    from axonn_launch.generate import HELP

    examples = [" ".join(x.split()) for x in HELP.splitlines() if "axonn_launch.generate " in x]
    examples = [x for x in examples if not x.startswith("usage:")]
    assert len(examples) >= 2 and set(examples) <= set(LINES), examples
