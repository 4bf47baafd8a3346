"""The job side's imports, made once per process at the least cost: with the collector off,
then frozen (``import_frozen``).

A rank imports torch, DCP and the job side (some 260,000 objects) before its first step.
With the collector on, the heap's growth during those imports sets off full collections
that scan everything imported so far, and the interpreter's teardown at the rank's exit
scans it all again and runs some 170 finalizers that undo torch.library's operator
registrations. On this project's 2-core machine that was about 1.3 of the 3.55 CPU-seconds
of a Slurm task that trains two steps (BENCHMARKS.md, "A rank's imports: the collector
off, then frozen"). Used by every rank that starts Python afresh (a Slurm task, ``python -m
axonn_launch.train``) and by a local job's zygote before it forks its ranks.
"""

from __future__ import annotations

import gc
import importlib
import sys
import weakref

# What a rank imports on its way to its first step: imported once, before the first step
# (or the zygote's fork), not a module a rank runs as __main__ (runpy warns when that is
# imported already)
RANK_IMPORTS = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.nn.functional",
    "torch.utils.checkpoint",
    "numpy",
    "axonn_launch.train",
    "axonn_launch.train.run",  # axonn_launch.train imports it only when a rank runs
    "axonn_launch.train.health.faults",
    "axonn_launch.train.checkpoint.export",
    "axonn_launch.train.checkpoint.state",  # checkpoints
    "torch.utils.serialization",  # torch.save
)


def import_frozen(modules: tuple[str, ...]) -> None:
    """Import ``modules`` with the collector off, keep torch.library's registrations at
    exit (``keep_registrations_at_exit``), and freeze every object made so far
    (``gc.freeze``): no later collection in this process or a child forked from it scans
    them. Nothing is done when they are all imported already (a rank forked by the zygote).

    The cyclic garbage made while importing (some 7,000 objects, a few hundred kB) is
    frozen with the rest, not freed; a collection to free it would cost a full scan."""
    if all(name in sys.modules for name in modules):
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            importlib.import_module(name)
        keep_registrations_at_exit()
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def keep_registrations_at_exit() -> None:
    """Turn off the exit-time run of the finalizers that undo torch.library's operator
    registrations made by the imports (some 170, one per library): each rank ran them
    all at its exit, 0.13 s of CPU, only to unregister operators in a process that is
    ending. The ranks' own registrations are undone as before."""
    for finalizer in list(weakref.finalize._registry):  # private: there is no public list
        found = finalizer.peek()
        if found is not None and getattr(found[1], "__module__", "") == "torch.library":
            finalizer.atexit = False
