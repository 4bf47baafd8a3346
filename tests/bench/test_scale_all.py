"""``bench/scale/all.py`` stops a stage that runs past its budget, with what the stage
started: SIGINT first, so that its ``finally`` blocks run (the scale cluster's stop.sh),
then SIGKILL to what is left of its session. Real processes: a stage that starts a
grandchild, as a stage's sbatch or start.sh would."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scale_all():
    spec = importlib.util.spec_from_file_location("scale_all", REPO / "bench/scale/all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_all"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("scale_all", None)


def stage_script(folder: Path, ignore_sigint: bool) -> Path:
    """A stage that starts a grandchild (its pid in ``grandchild``), says it is ready, and
    writes ``cleaned`` in its ``finally``."""
    script = folder / "stage.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal, subprocess, sys, time
        from pathlib import Path
        folder = Path({str(folder)!r})
        if {ignore_sigint}:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "600"])
        (folder / "grandchild").write_text(str(child.pid))
        try:
            time.sleep(600)
        finally:
            (folder / "cleaned").write_text("yes")
    """)
    )
    return script


def gone(pid: int) -> bool:
    """Whether ``pid`` ended (absent, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return check()


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["cleans-up", "ignores-sigint"])
def test_a_stage_past_its_budget_is_stopped_with_what_it_started(
    scale_all, tmp_path, monkeypatch, ignore_sigint
):
    monkeypatch.setattr(scale_all, "GRACE_S", 2.0)
    script = stage_script(tmp_path, ignore_sigint)
    stage = scale_all.Stage("fake", (str(script),), "none.json", 1.0)
    began = time.monotonic()
    row = scale_all.run_stage(stage, 3.0)
    assert row["rc"] is None and row["wall_s"] >= 3.0, row
    assert time.monotonic() - began < 30, row
    grandchild = int((tmp_path / "grandchild").read_text())
    assert until(lambda: gone(grandchild), 10), "the stage's grandchild outlived it"
    if ignore_sigint:
        assert row["tail"].startswith("killed at the budget (no end 2 s after SIGINT)"), row
        assert not (tmp_path / "cleaned").exists()
    else:
        assert row["tail"].startswith("stopped at the budget (SIGINT)"), row
        assert (tmp_path / "cleaned").read_text() == "yes"
    assert sys.executable == scale_all.stage_args(stage, 1.0)[0]
