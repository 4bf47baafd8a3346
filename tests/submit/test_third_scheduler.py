"""A third scheduler is one module plus one registration line (docs/architecture.md, "Where to
add"): ``FakeQueue`` below is the module, ``register(FakeQueue())`` the line. A machine
profile kept in a site directory names it, and a dry run through the Python API composes,
checks, resolves and renders the job with it: the profile schema accepts the name, the
summary is written, and the rendered run is the scheduler's own text. Nothing else in the
package is touched."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

import pytest

from axonn_launch import api
from axonn_launch.common import machine
from axonn_launch.scheduler import Scheduler, base, register

LOCAL_PROFILE = Path(api.__file__).parent / "conf" / "machine" / "local.yaml"


class FakeQueue(Scheduler):
    """A scheduler the package does not know: its ranks start through ``fakerun``."""

    name = "fake_queue"

    def run_text(self, command: list[str], world_size: int) -> str:
        return f"fakerun --ranks {world_size} -- {shlex.join(command)}"


@pytest.fixture
def fake_queue():
    register(FakeQueue())  # the one registration line
    yield
    base.SCHEDULERS.pop(FakeQueue.name)
    machine.SCHEDULERS.remove(FakeQueue.name)


def site_naming(tmp_path: Path, scheduler_name: str) -> Path:
    """A site directory with one machine, ``fakebox``: this computer's profile under another
    name and scheduler."""
    text = LOCAL_PROFILE.read_text()
    text = text.replace("name: local", "name: fakebox").replace(
        "scheduler: local", f"scheduler: {scheduler_name}"
    )
    (tmp_path / "site" / "machine").mkdir(parents=True)
    (tmp_path / "site" / "machine" / "fakebox.yaml").write_text(text)
    return tmp_path / "site"


def test_a_fake_third_scheduler_renders_a_dry_run(tmp_path, fake_queue):
    site = site_naming(tmp_path, FakeQueue.name)
    job_dir = tmp_path / "job"
    run = api.compose(["machine=fakebox", "model=gpt_tiny", "train.steps=2",
                       f"hydra.run.dir={job_dir}"], site=site)  # fmt: skip
    assert run.launch.machine.scheduler == FakeQueue.name
    out = io.StringIO()
    job = api.launch(run, dry_run=True, out=out)
    printed = out.getvalue()
    assert "fakerun --ranks 4 -- " in printed  # the local profile's 2 x 2 grid
    assert f"-m axonn_launch.train {job_dir}" in printed
    assert "local processes" not in printed  # not the local scheduler's words
    record = json.loads((Path(job.job_dir) / "job.json").read_text())
    assert record["scheduler"] == FakeQueue.name and record["status"] == "dry_run"


def test_without_its_registration_line_the_profile_is_one_line_naming_the_valid_ones(tmp_path):
    site = site_naming(tmp_path, FakeQueue.name)
    with pytest.raises(api.LaunchError) as error:
        api.compose(["machine=fakebox", "model=gpt_tiny"], site=site)
    said = str(error.value)
    assert len(said.splitlines()) == 1
    assert "machine.scheduler='fake_queue'" in said and "local, slurm" in said
