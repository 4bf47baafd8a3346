"""The commands of the user guide's ```text blocks (those that need what is not here: a
Hugging Face checkpoint, LUMI, a job's ``<time>``, a 25-minute study) run with the named
substitutions below; the ```bash blocks run as written in test_readme.py.

Each ```text block of README.md and docs/guide/*.md is either commands (its first line
starts with ``python -m``) or output (it must hold no ``python -m axonn_launch``). Every
line of a command block is read out of the page (continuation lines joined, comments
dropped), rewritten by SUBSTITUTIONS in order (each must still match some line), and run
from one temporary workspace, each distinct command once:

- launcher lines get ``dry_run=true`` (LUMI; the local lines' training is a 2-step run of
  TRAINED's model below and tests/train/test_finetune_hf.py), except TRAINED, which trains
  for real with test_readme.py's rule for local lines (``train.steps=2
  train.sample_tokens=0``) into the job dir that the guide's export line names; the
  memorization study runs 2 of its 18 points (STUDY_SMALLEST) as a dry run, one after the
  other (the study trains for real, two points at a time, in tests/commands/test_study.py);
- ``data``, ``export``, ``report`` and ``jobs`` lines run their ``main`` in this process
  (the same argv; tests/commands/ runs them as processes), each must exit 0, except
  ``jobs sync``, which must refuse in one line, exit 2: the job trained here has no W&B run
  (tests/train/test_sinks.py syncs a real offline run);
- ``tensorboard --logdir DIR`` is not run (not ours): DIR must hold TensorBoard's events.

The workspace holds what the lines expect to find: ``llama_dir/`` (tests/hf_fixtures.py's
tiny Llama with its tokenizer, with Llama 3.2's context), ``chats.jsonl``, ``data/``,
``tok/tokenizer.json``, ``corpus/`` and ``extra.jsonl``; the sweeps the report lines read are
copies of the trained job in a sweep's layout (``points/<n>.json``), and ``plan.json`` is
the planner's ``output=json`` (``top=20``) for that job's model.

About 9 CPU-seconds: one 2-step training of 4 local processes, transformers imported once (the
tiny Llama, the data line), the rest dry runs and in-process commands.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.cli_server import run_module
from tests.conftest import REPO
from tests.hf_fixtures import sft_examples, tiny_llama_dir, train_tokenizer, write_jsonl
from tests.journeys.test_readme import LINES as BASH_LINES

PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
JOB = "jobs/hf-local/2026-12-01_08-00-00"  # the job dir the guide's export line names
SUBSTITUTIONS = [  # (text in the guide, what runs here, why)
    ("/models/Llama-3.2-1B", "llama_dir/", "no downloads: the tiny Llama built here"),
    ("jobs/hf-lumi/<time> --hf llama_sft/", f"{JOB} --hf llama_out/",
     "no LUMI: the export of the local job, the same command as the guide's other export"),
    ("jobs/gpt_tiny-local/<time>", JOB, "the one job trained here (any job dir will do)"),
    ("jobs/sweeps/memorization_<time>", "jobs/sweeps/memorization",
     "the study's 2 points k=0, 4 as copies of JOB with memorization.json"),
    ("jobs/sweeps/<time>", "jobs/sweeps/lr", "2 points over train.lr as copies of JOB"),
]  # fmt: skip
TRAINED = "python -m axonn_launch model=hf model.init_from=llama_dir/"
QUICK = ["train.steps=2", "train.sample_tokens=0", f"hydra.run.dir={JOB}"]
# 2 of the study's 18 points, joblib running them in turn in its own process (n_jobs=1)
STUDY_SMALLEST = ["study.repetitions=1", "model=study_xs", "hydra.launcher.n_jobs=1"]
EXPECTED = {  # module -> (exit code, text its output must hold)
    "axonn_launch.data": (0, "wrote data/"),
    "axonn_launch.export": (0, f"tensors of {JOB}/checkpoints/step_00000002 to llama_out"),
    "axonn_launch.report": (0, "report.md"),
    "axonn_launch.jobs": (2, "no offline W&B run in"),
}


def command_blocks() -> tuple[list[list[str]], list[str]]:
    """(the text blocks that hold commands, each as its lines; the other text blocks)."""
    text = "".join(page.read_text() for page in PAGES)
    commands, output = [], []
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.S):
        if not block.startswith("python -m "):
            output.append(block)
            continue
        lines = (shlex.split(x, comments=True) for x in block.replace("\\\n", " ").splitlines())
        commands.append([" ".join(x) for x in lines if x])
    return commands, output


def substitute(line: str) -> str:
    for text, replacement, _ in SUBSTITUTIONS:
        line = line.replace(text, replacement)
    return line


BLOCKS, OUTPUT = command_blocks()
GUIDE_LINES = [line for block in BLOCKS for line in block]
RUN = list(dict.fromkeys(substitute(x) for x in GUIDE_LINES if x not in BASH_LINES))


def test_every_text_block_command_is_run_and_every_substitution_applies():
    assert len(BLOCKS) >= 6 and TRAINED in RUN, RUN
    for text, _, _ in SUBSTITUTIONS:
        assert any(text in line for line in GUIDE_LINES), f"no guide line holds {text!r}"
    for block in OUTPUT:  # output, not commands
        assert "python -m axonn_launch" not in block, block
    for line in RUN:
        assert line.startswith(("python -m axonn_launch", "tensorboard --logdir ")), line
        assert not re.search(r"<\w+>|\.\.\.", line), f"a placeholder left: {line!r}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("guide")
    tiny_llama_dir(root / "llama_dir", max_position_embeddings=131072)
    write_jsonl(root / "chats.jsonl", sft_examples())
    (root / "data").mkdir()
    (root / "tok").mkdir()
    train_tokenizer(chars=20_000).save(str(root / "tok" / "tokenizer.json"))
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("To be, or not to be, that is the question.\n")
    (root / "corpus" / "b.txt").write_text("Once more unto the breach, dear friends.\n")
    write_jsonl(root / "extra.jsonl", [{"text": "A horse! A horse! My kingdom for a horse!"}])
    return root


@pytest.fixture(scope="module")
def trained(workspace: Path):
    """TRAINED, as the guide has it, for 2 steps into JOB."""
    proc = run_module("axonn_launch", [*TRAINED.split()[3:], *QUICK], cwd=workspace, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def copy_point(sweep: Path, num: int, overrides: str, k: int | None = None) -> None:
    """A copy of JOB as completed point NUM of SWEEP (its ``points/<num>.json``); with a
    Goldfish K, a study's point: K in its spec.json, and a memorization.json."""
    job = sweep / str(num)
    shutil.copytree(sweep.parents[2] / JOB, job, ignore=shutil.ignore_patterns("checkpoints"))
    if k is not None:
        spec = json.loads((job / "spec.json").read_text())
        spec["train"]["goldfish"] = {"k": k, "h": 4, "strategy": "hash-table"}
        (job / "spec.json").write_text(json.dumps(spec))
        memo = {"exact_match_rate": 0.5 - k / 10, "rouge_l": 0.6, "n_documents": 20}
        (job / "memorization.json").write_text(json.dumps(memo))
    record = {"num": num, "point": overrides, "status": "completed", "job_dir": str(job),
              "job_id": "", "nodes": 1, "message": "", "objective": "final_loss"}  # fmt: skip
    (sweep / "points").mkdir(parents=True, exist_ok=True)
    (sweep / "points" / f"{num}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def sweeps(workspace: Path, trained) -> None:
    """jobs/sweeps/lr, jobs/sweeps/memorization and plan.json, from the trained job."""
    for num, lr in enumerate(["0.001", "0.003"]):
        copy_point(workspace / "jobs/sweeps/lr", num, f"train.lr={lr}")
    for num, k in enumerate([0, 4]):
        point = f"study.repetitions=1 train.goldfish.k={k}"
        copy_point(workspace / "jobs/sweeps/memorization", num, point, k)
    argv = [*TRAINED.split()[3:], "nodes=1", "top=20", "output=json"]
    plan = run_module("axonn_launch.plan", argv, cwd=workspace)
    assert plan.returncode == 0, plan.stderr
    (workspace / "plan.json").write_text(plan.stdout)


def launcher_argv(line: str) -> list[str]:
    args = line.split()[3:]
    if "+study=memorization" in args:
        args += STUDY_SMALLEST
    return args if "dry_run=true" in args else [*args, "dry_run=true"]


@pytest.mark.parametrize("line", RUN, ids=RUN)
def test_guide_text_line_runs(line: str, workspace: Path, request, capfd, monkeypatch):
    words = line.split()
    if words[0] == "tensorboard":
        request.getfixturevalue("trained")
        assert list((workspace / words[2]).glob("events.out.tfevents.*")), words[2]
        return
    module, args = words[2], words[3:]
    if line == TRAINED:
        output = request.getfixturevalue("trained").stdout
        assert "done: 2 steps" in output, output[-3000:]
        assert (workspace / JOB / "checkpoints").is_dir()
        return
    if module == "axonn_launch":
        proc = run_module(module, launcher_argv(line), cwd=workspace, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-3000:]
        local = "machine=" not in line or "machine=local" in line
        shown = "--- local command ---" if local else "--- batch script ---"
        assert ("sweep summary:" if "-m" in args else shown) in output, output[-3000:]
        if "train.goldfish.k=4" in args:  # the guide quotes this summary line
            assert "loss       Goldfish: about 1 label in 4 left out of the loss" in output
        return
    request.getfixturevalue("sweeps" if module == "axonn_launch.report" else "workspace")
    if module in ("axonn_launch.export", "axonn_launch.jobs"):
        request.getfixturevalue("trained")
    monkeypatch.chdir(workspace)
    code = importlib.import_module(module).main(args)
    out, err = capfd.readouterr()
    expected_code, text = EXPECTED[module]
    assert code == expected_code and text in out + err, out[-3000:] + err[-3000:]
    if code:
        assert len(err.strip().splitlines()) == 1, err
    if module == "axonn_launch.report":
        folder = args[args.index("--out") + 1] if "--out" in args else f"{args[0]}/report"
        assert report_shows(args) in (workspace / folder / "report.md").read_text()


def report_shows(args: list[str]) -> str:
    """What the report a report line writes must show."""
    if "--plan" in args:
        return "| grid | predicted s | measured s | measured / predicted |"
    if "--metric" in args:
        return f"metric: {args[args.index('--metric') + 1]}"
    return "## Memorization" if "memorization" in args[0] else "![loss](loss.png)"
