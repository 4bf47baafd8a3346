"""Bad input: exit code 2, one line naming the field and value, nothing submitted or written."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, run_launcher

F5 = ["machine=frontier", "model=gpt_5b"]
# (arguments, text the one-line error must contain)
CASES = [
    (["machine=foo"], "machine='foo'"),
    (["model=gpt_7b"], "model='gpt_7b'"),
    (["train.stpes=3"], "train.stpes: unknown key; did you mean train.steps?"),
    (["gird.x=2"], "gird.x: unknown key; did you mean grid.x?"),
    (["model=gpt_tnyi"], "model='gpt_tnyi': no such model; did you mean gpt_tiny?"),
    (["+foo=1"], "foo"),
    (["train.steps=abc"], "train.steps='abc'"),
    (["train.steps=0"], "train.steps=0"),
    (["train.lr=-1"], "train.lr=-1"),
    (["train.lr=[1"], "train.lr=[1"),
    (["train.watchdog.beat_s=0"], "train.watchdog.beat_s=0.0: expected a number > 0"),
    (["train.stragglers.every=-1"], "train.stragglers.every=-1"),
    (["train.dtype=fp8"], "train.dtype='fp8'"),
    (["train.schedule=linear"], "train.schedule='linear'"),
    (["train.data=/nonexistent/tokens.bin"], "train.data='/nonexistent/tokens.bin'"),
    (["train.seq_len=128"], "train.seq_len=128"),
    (["train.micro_batch=3"], "train.micro_batch=3"),
    (["train.global_batch=12", "train.micro_batch=8"], "train.global_batch=12"),
    (["grid.data=3"], "train.global_batch=16: must be a multiple of grid.data*grid.z=3"),
    (["train.overlap.all_gather=maybe"], "train.overlap.all_gather='maybe'"),
    (["train.wire.all_gather=fp16"], "train.wire.all_gather='fp16'"),
    (["train.wire.all_reduce=1"], "train.wire.all_reduce='1'"),
    (["train.cache_layers=3"], "train.cache_layers=3: must be between 0 and model.n_layer=2"),
    (["train.cache_layers=-1"], "train.cache_layers=-1"),
    (["train.ors_window=-2"], "train.ors_window=-2"),
    (["train.gemm_tuning=sometimes"], "train.gemm_tuning='sometimes'"),
    (["train.threads=-1"], "train.threads=-1: must be >= 0"),
    (
        ["generate.prompts=p.jsonl", "generate.max_new_tokens=64"],
        "generate.max_new_tokens=64: must be between 1 and model.max_seq_len-1=63",
    ),
    (["generate.prompts=p.jsonl", "generate.batch_size=0"], "generate.batch_size=0"),
    (["generate.prompts=p.jsonl", "generate.top_k=-1"], "generate.top_k=-1: must be >= 0"),
    (["memorization.data=d.jsonl", "memorization.continuation=0"], "memorization.continuation=0"),
    (["memorization.data=d.jsonl", "memorization.batch_size=0"], "memorization.batch_size=0"),
    (["dry_run=maybe"], "dry_run='maybe'"),
    (
        ["metrics.sinks=[jsonl,tensorbord]"],
        "metrics.sinks=['jsonl', 'tensorbord']: unknown sink 'tensorbord'; valid: jsonl,",
    ),
    (["grid.x=0"], "grid.x=0"),
    (["grid.x=two"], "grid.x='two'"),
    (["grid.y=3"], "grid.y=3"),
    (["grid.x=3"], "grid.x=3: must divide model.d_model=64"),
    (["grid.z=3", "train.micro_batch=6", "train.global_batch=12"], "grid.z=3"),
    (["grid.data=65", "train.micro_batch=1", "train.global_batch=65"], "max_local_processes"),
    (["nodes=2"], "nodes=2"),
    # more than this computer's RAM: refused before any rank starts
    (["model=gpt_320b"], "4 ranks x 3534.92 GiB (the estimate per rank of model=gpt_320b)"),
    (["machine=local", "model=gpt_320b"], "or machine.host_memory_check=false to start it"),
    (["machine.host_memory_headroom=1"], "machine.host_memory_headroom=1.0: must be >= 0 and < 1"),
    (["grid=auto", "grid.x=2"], "grid=auto"),
    (["model.n_head=5"], "model.d_model=64"),
    (["name=a/b"], "name='a/b'"),
    # a control character in what reaches an #SBATCH line or the job dir
    (
        ["machine=slurm_local", "machine.slurm.partition='debug\nsrun rm'"],
        "machine.slurm.partition='debug\\nsrun rm': holds control characters ('\\n')",
    ),
    (
        ["machine=perlmutter", "site.accounts.perlmutter='m1_g\n#SBATCH --qos=x'"],
        "site.accounts.perlmutter='m1_g\\n#SBATCH --qos=x': holds control characters",
    ),
    (
        ["machine=slurm_local", "+machine.slurm.extra_sbatch.mail-type='END\nx'"],
        "machine.slurm.extra_sbatch.mail-type='END\\nx': holds control characters",
    ),
    (["machine=slurm_local", "hydra.run.dir='run\nx'"], "hydra.run.dir="),
    (["machine=slurm_local", "hydra.run.dir=run%j"], "holds %j, which submitit replaces"),
    ([*F5, "grid.x=4", "dry_run=true"], "world size 4"),
    ([*F5, "grid.x=8", "nodes=2", "dry_run=true"], "nodes=2"),
    (["machine=frontier", "model=gpt_320b", "grid.x=8", "dry_run=true"], "GiB per GPU"),
    (["machine=perlmutter", "model=gpt_5b", "grid.x=4"], "machine.slurm.account"),
    (["machine=slurm_local", "grid.x=3", "grid.y=1"], "grid.x=3"),
    (  # the job would fail in VocabParallelEmbedding: 65 rows of 64 do not split over z=128
        [
            "machine=perlmutter",
            "model.vocab_size=65",
            "train.data=synthetic",
            "grid.z=128",
            "train.micro_batch=128",
            "train.global_batch=128",
            "dry_run=true",
        ],  # fmt: skip
        "grid.z=128: must divide the token table block of 4160 elements",
    ),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_happens(args, expected, tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    work = tmp_path / "cwd"
    work.mkdir()
    result = run_launcher(args, cwd=work, path_prefix=bindir)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not marker.exists(), "sbatch was called"
    assert list(work.iterdir()) == [], "something was written"


def test_full_error_shows_the_traceback_when_asked(tmp_path):
    result = run_launcher(["grid.y=3"], cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_a_python_without_the_dependencies_gets_one_line_and_exit_2(tmp_path):
    code = (
        "import runpy, sys; sys.modules['hydra'] = None; "  # as if hydra were not installed
        "runpy.run_module('axonn_launch', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no module named 'hydra'" in lines[0], proc.stderr
    assert "machines/local/setup.sh" in lines[0]
