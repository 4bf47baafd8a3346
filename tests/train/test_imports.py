"""A rank that starts Python afresh (a Slurm task, ``python -m axonn_launch.train``) imports
the job side with the collector off and freezes what it imported (``import_frozen`` in
``train/zygote.py``, called by ``train.run_job``), as a local job's zygote does before it
forks.

One fresh interpreter (about 2 s: it imports torch) makes the rank's imports as
``run_job`` makes them and reports the collector's state after."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import gc, json, sys, weakref
gc_before = gc.isenabled()
from axonn_launch.train.zygote import RANK_IMPORTS, import_frozen
import_frozen(RANK_IMPORTS)
frozen = gc.get_freeze_count()
undone_at_exit = sum(
    1 for f in list(weakref.finalize._registry)
    if (found := f.peek()) is not None
    and getattr(found[1], "__module__", "") == "torch.library" and f.atexit
)
import_frozen(RANK_IMPORTS)  # all imported: nothing more is frozen, the collector stays on
print(json.dumps({
    "enabled_before": gc_before, "enabled_after": gc.isenabled(), "frozen": frozen,
    "frozen_again": gc.get_freeze_count(), "torch": "torch" in sys.modules,
    "undone_at_exit": undone_at_exit,
    "library_finalizers": sum(
        1 for f in list(weakref.finalize._registry)
        if (found := f.peek()) is not None
        and getattr(found[1], "__module__", "") == "torch.library"
    ),
}))
"""


@pytest.fixture(scope="module")
def probed() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_the_job_side_is_imported_and_frozen_with_the_collector_on_after(probed):
    assert probed["torch"]
    assert probed["enabled_before"] and probed["enabled_after"]
    # torch, DCP and the job side: some 260,000 objects, all frozen
    assert probed["frozen"] > 100_000, probed


def test_torch_library_registrations_are_not_undone_at_exit(probed):
    assert probed["library_finalizers"] > 50, probed  # torch's own, one per library
    assert probed["undone_at_exit"] == 0, probed


def test_a_second_call_with_everything_imported_freezes_nothing_more(probed):
    assert probed["frozen_again"] == probed["frozen"], probed
