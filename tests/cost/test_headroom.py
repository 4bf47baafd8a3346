"""Headroom: the planner keeps 10% of GPU memory free where it can at
the node count it plans for, a run above 90% gets a warning naming its fixes (each checked
here against the memory model and by applying it), and predictions name the hardware they
assume: a rehearsal's are the site's, CPU ranks get none. Login-node functions only."""

from __future__ import annotations

import dataclasses
import re

import pytest

from axonn_launch.config.compose import load
from axonn_launch.config.resolve import resolve
from axonn_launch.cost import planner
from axonn_launch.cost.memory import GIB, estimate_memory
from axonn_launch.submit import rehearse
from axonn_launch.submit.pipeline import recovery_line
from axonn_launch.submit.summary import headroom_warnings, predicted_step_s, summary

DRY = ["train.data=synthetic", "dry_run=true"]


def launch(*overrides: str):
    cfg = load([*overrides, *DRY])
    return cfg, resolve(cfg)


def field(text: str, label: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{label:<10} ")]
    return line[11:]


def test_the_default_pick_prefers_headroom_over_a_faster_grid_at_the_same_node_count():
    """llama3_70b on 16 Perlmutter nodes: the fastest row sat at 92% of GPU memory (the launch
    summary showed it); grid=auto now takes the fastest row within 90%, on the same 16 nodes."""
    cfg, resolved = launch("machine=perlmutter", "model=llama3_70b")
    rows = planner.rank_machine(cfg.machine, cfg.model, cfg.train, 16, None).rows
    first, tight = rows[0], [r for r in rows if not r.headroom]
    assert resolved.nodes == 16 and resolved.grid == first.grid
    assert resolved.train.micro_batch == first.micro_batch
    assert first.headroom and first.memory_share <= 0.9
    assert resolved.memory.total == pytest.approx(first.memory.total)
    assert tight and min(r.step_time_s for r in tight) < first.step_time_s  # speed given up
    assert all(r.step_time_s >= first.step_time_s for r in rows if r.headroom)
    assert headroom_warnings(cfg, resolved) == []


@pytest.mark.parametrize(
    ("model", "nodes", "shown", "fix"),
    [("gpt_80b", 8, "39.9 of 40 GiB per GPU (100%)", 16),
     ("llama3_8b", 1, "39.4 of 40 GiB per GPU (99%)", 2)],
)  # fmt: skip
def test_a_tight_default_is_warned_with_a_node_count_that_has_headroom(model, nodes, shown, fix):
    """No row of these node counts has headroom: the fastest is kept, and the warning names
    the fewest of nodes+1, nodes+2, 2 x nodes whose planner pick has it; applied, it is quiet."""
    cfg, resolved = launch("machine=perlmutter", f"model={model}")
    rows = planner.rank_machine(cfg.machine, cfg.model, cfg.train, nodes, None).rows
    assert resolved.nodes == nodes and not any(r.headroom for r in rows)
    assert resolved.grid == min(rows, key=lambda r: r.step_time_s).grid
    (warning,) = headroom_warnings(cfg, resolved)
    assert warning.startswith(f"memory: {shown} is above 90%")
    more = "one more node" if fix == nodes + 1 else "twice the nodes"
    assert f"for headroom: nodes={fix} ({more}; the planner's " in warning
    fixed_cfg, fixed = launch("machine=perlmutter", f"model={model}", f"nodes={fix}")
    assert fixed.memory.total / GIB <= 36 and headroom_warnings(fixed_cfg, fixed) == []
    assert f"{fixed.grid.describe()} there: {fixed.memory.total / GIB:.1f} GiB" in warning


@pytest.mark.parametrize(
    "tight",
    [["train.micro_batch=16"], ["train.micro_batch=4", "train.activation_checkpointing=false"]],
    ids=["micro-batch", "activation-checkpointing"],
)
def test_each_named_fix_gives_the_memory_it_says(tight):
    """An explicit grid at 93%: each override the warning names, with the GiB the memory
    model gives for it (a smaller micro-batch, activation checkpointing, fewer cached
    blocks), and more nodes through grid=auto."""
    cfg, resolved = launch("machine=perlmutter", "model=gpt_5b", "grid.z=4", "nodes=1",
                           "train.global_batch=64", "train.cache_layers=8", *tight)  # fmt: skip
    assert 0.9 < resolved.memory.total / (40 * GIB) <= 1
    (warning,) = headroom_warnings(cfg, resolved)
    assert "grid=auto nodes=2 (one more node; " in warning
    fixes = {key: (value, gib) for key, value, gib in
             re.findall(r"train\.(\w+)=(\w+) \([^:]+: ([\d.]+) GiB", warning)}  # fmt: skip
    other = "micro_batch" if len(tight) == 1 else "activation_checkpointing"
    assert set(fixes) == {"cache_layers", other}
    for key, (value, gib) in fixes.items():
        changed = dataclasses.replace(
            resolved.train, **{key: True if value == "true" else int(value)}
        )
        memory = estimate_memory(model=cfg.model, grid=resolved.grid, train=changed).total
        assert f"{memory / GIB:.1f}" == gib and memory < resolved.memory.total
    cache = int(fixes["cache_layers"][0])  # the most blocks that keep 90%
    for blocks, fits in ((cache, True), (cache + 1, False)):
        kept = dataclasses.replace(resolved.train, cache_layers=blocks)
        memory = estimate_memory(model=cfg.model, grid=resolved.grid, train=kept).total
        assert (memory <= 36 * GIB) == fits


def test_predictions_name_their_hardware_and_cpu_runs_get_none(tmp_path):
    cfg, resolved = launch("machine=perlmutter", "model=gpt_5b", "site.accounts.perlmutter=m1")
    text = summary(cfg, resolved, tmp_path)
    step = resolved.step_time.total
    assert field(text, "predicted").startswith(
        f"{step:.4g} s/step on perlmutter's A100-SXM4-40GB (planner, uncalibrated) x "
    )
    assert field(text, "goodput").startswith(
        f"{resolved.checkpointing.goodput:.1%} expected on perlmutter"
    )
    assert predicted_step_s(cfg, resolved) == step

    for machine in ("local", "slurm_local"):
        cfg, resolved = launch(f"machine={machine}")
        text = summary(cfg, resolved, tmp_path)
        assert "expected" not in text and predicted_step_s(cfg, resolved) is None
        assert field(text, "goodput").startswith("not predicted for CPU ranks")
        if machine == "slurm_local":
            assert field(text, "predicted").startswith("none (CPU ranks: ")


def test_a_rehearsal_marks_the_site_prediction_as_the_sites(tmp_path):
    site = load(["machine=alps", "rehearse=true", *DRY])
    cfg = rehearse.site_config(site)
    resolved = resolve(cfg)
    text = summary(cfg, resolved, tmp_path)
    step = resolved.step_time.total
    assert field(text, "predicted") == (
        f"site only: {step:.4g} s/step on alps's GH200 (planner, uncalibrated);"
        " this rehearsal runs on local CPUs: no prediction"
    )
    goodput = field(text, "goodput")
    assert goodput.startswith(f"site only: {resolved.checkpointing.goodput:.1%} expected on alps")
    assert goodput.endswith("this rehearsal runs on local CPUs: measured (jobs status)")
    assert predicted_step_s(cfg, resolved) is None


def test_the_recovery_line_does_not_read_as_if_recovery_were_off():
    line = recovery_line("18", "17")
    assert line.startswith("recovery: job 18 starts if job 17 fails, and resumes it")
    assert "recovery=off: none" not in line and "recovery=off submits no recovery job" in line
