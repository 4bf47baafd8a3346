"""Predicted goodput and the checkpoint interval: Daly's interval, ``auto`` in steps,
the goodput formula, the figures ``plan`` and the launch summary print, and bad input.

Every expected number is computed here from the formula in ``cost/expected_goodput.py``'s docstring,
independently of the module (or, where stated, written out by hand)."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import resolve
from axonn_launch.cost import expected_goodput as goodput
from axonn_launch.cost.perf import step_time
from axonn_launch.plan import main as plan_main
from tests.conftest import REPO, run_launcher

BYTES_PER_ELEMENT = 4 + 4 + 4  # fp32 parameter, exp_avg, exp_avg_sq
LLAMA3_NODE_HOURS = 54 * 24 * 2048 / 419  # 419 interruptions, 54 days, 2,048 nodes of 8 GPUs
FRONTIER_320B = ["machine=frontier", "model=gpt_320b", "nodes=1024"]
THIS_TREE = {"PYTHONPATH": str(REPO)}  # the launcher of this checkout, from any directory


def restart_by_hand(nodes: int) -> float:
    """R - δ on Frontier at ``nodes`` (>= 16: it broadcasts, every phase counts): the 600 s
    detection plus each phase of conf/startup.yaml, a + b * f(N), written out by hand."""
    raw = yaml.safe_load((REPO / "axonn_launch" / "conf" / "startup.yaml").read_text())
    shape = {"constant": 0, "linear": nodes, "n_log_n": nodes * math.log2(nodes),
             "quadratic": nodes**2}  # fmt: skip
    return 600 + sum(max(0.0, p["a"] + p.get("b", 0) * shape[p["form"]])
                     for p in raw["phases"].values())  # fmt: skip


def daly(save_s: float, mtbf_s: float) -> float:
    """Daly 2006, first order: sqrt(2 δ M) - δ for δ < 2M, else M."""
    return math.sqrt(2 * save_s * mtbf_s) - save_s if save_s < 2 * mtbf_s else mtbf_s


def first_order_goodput(tau: float, save: float, restart: float, mtbf: float) -> float:
    value = tau / (tau + save) * (1 - (restart + (tau + save) / 2) / mtbf)
    return min(1.0, max(0.0, value))


def auto_steps(cfg, nodes: int, step_s: float) -> int:
    """``auto``'s steps from the profile's numbers, as the docstring says."""
    rel = cfg.machine.reliability
    save = BYTES_PER_ELEMENT * cfg.model.n_params() / (nodes * rel.write_gbps_per_node * 1e9)
    mtbf = rel.node_mtbf_hours * 3600 / nodes
    return max(1, round(daly(save, mtbf) / step_s))


# --------------------------------------------------------------------------- the formulas


@pytest.mark.parametrize(
    "save_s,mtbf_s",
    [(10.0, 3600.0), (8.1, 22271.5), (0.5, 100.0), (0.0, 100.0), (150.0, 100.0), (199.9, 100.0),
     (200.0, 100.0), (1e4, 100.0)],
)  # fmt: skip
def test_the_interval_is_dalys_formula(save_s, mtbf_s):
    assert goodput.daly_interval(save_s, mtbf_s) == pytest.approx(daly(save_s, mtbf_s), rel=1e-12)


def test_the_interval_by_hand():
    # sqrt(2 x 50 x 5000) - 50 = sqrt(500000) - 50 = 707.10678 - 50
    assert goodput.daly_interval(50, 5000) == pytest.approx(657.10678, abs=1e-5)
    # δ >= 2M: one MTBF
    assert goodput.daly_interval(250, 100) == 100 and goodput.daly_interval(200, 100) == 100
    # Young's sqrt(2 δ M) less δ: the two agree while δ << M
    young = math.sqrt(2 * 1 * 1e6)
    assert goodput.daly_interval(1, 1e6) == pytest.approx(young, rel=1e-3)
    with pytest.raises(ValueError):
        goodput.daly_interval(1, 0)


def test_goodput_formula_values():
    # 600 / 610 x (1 - (900 + 610 / 2) / 22000) = 0.98360656 x 0.94522727, by hand
    assert goodput.expected_goodput(600, 10, 900, 22000) == pytest.approx(0.929732, abs=1e-6)
    for tau, save, restart, mtbf in [(600, 10, 900, 22000), (1, 0.01, 60, 3600), (50, 5, 0, 1e5)]:
        got = goodput.expected_goodput(tau, save, restart, mtbf)
        assert got == pytest.approx(first_order_goodput(tau, save, restart, mtbf), rel=1e-12)
    assert goodput.expected_goodput(600, 10, 5000, 3000) == 0.0  # clamped: restarts outrun M
    assert goodput.expected_goodput(1e6, 10, 900, 22000) == 0.0  # a segment far beyond M
    assert goodput.expected_goodput(600, 0, 0, 1e12) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(
    "save,restart,mtbf,within",
    [(8.0, 900.0, 22000.0, 1e-5), (1.0, 60.0, 1e5, 1e-8), (60.0, 900.0, 3600.0, 2e-3)],
)
def test_dalys_interval_is_near_the_best_of_the_goodput_model(save, restart, mtbf, within):
    """The first-order goodput at Daly's interval is close to its best over intervals in steps
    of 0.1 s: within 0.001 percentage points where δ << M (the planned scales), 0.2 where a
    save is a sixtieth of the MTBF."""
    best = max(first_order_goodput(t / 10, save, restart, mtbf) for t in range(1, 200000))
    at_daly = first_order_goodput(goodput.daly_interval(save, mtbf), save, restart, mtbf)
    assert best - within <= at_daly <= best + 1e-9


def test_auto_resolves_to_that_many_steps_for_a_given_step_time():
    assert goodput.interval_steps(593.0, 5.17) == 115  # 114.70
    assert goodput.interval_steps(0.2, 5.0) == 1  # at least one step
    assert goodput.interval_steps(10.4, 1.0) == 10
    cfg = load(["machine=local"])
    for step_s in (0.01, 0.5, 3.0):
        ck = goodput.predict(
            machine=cfg.machine, model=cfg.model, nodes=1, step_s=step_s, steps=100, every=None
        )
        assert ck.auto and ck.every == ck.auto_steps == auto_steps(cfg, 1, step_s)
        assert ck.goodput == pytest.approx(
            first_order_goodput(ck.every * step_s, ck.save_s, 60 + ck.save_s, 3600), rel=1e-12
        )
    given = goodput.predict(
        machine=cfg.machine, model=cfg.model, nodes=1, step_s=0.5, steps=100, every=40
    )
    assert not given.auto and given.every == 40 and given.interval_s == 20.0
    end_only = goodput.predict(
        machine=cfg.machine, model=cfg.model, nodes=1, step_s=0.5, steps=100, every=0
    )
    assert end_only.interval_s == 50.0  # the whole run is one segment
    measured = goodput.predict(machine=cfg.machine, model=cfg.model, nodes=1, step_s=0.5,
                               steps=100, every=None, measured_save_s=30.0)  # fmt: skip
    assert measured.save_measured and measured.save_s == 30.0
    assert measured.optimal_s == pytest.approx(daly(30.0, 3600.0), rel=1e-12)


def test_auto_is_resolved_on_the_login_node_from_the_predicted_step():
    cfg = load([*FRONTIER_320B, "grid=auto", "train.checkpoint_every=auto", "dry_run=true"])
    assert cfg.train.checkpoint_every is None  # auto, until resolved
    resolved = resolve(cfg)
    step = step_time(hardware=cfg.machine.hardware, model=cfg.model, train=resolved.train,
                     grid=resolved.grid).total  # fmt: skip
    assert resolved.train.checkpoint_every == auto_steps(cfg, 1024, step)
    assert resolved.checkpointing.goodput == pytest.approx(
        first_order_goodput(
            resolved.train.checkpoint_every * step,
            resolved.checkpointing.save_s,
            restart_by_hand(1024) + resolved.checkpointing.save_s,  # restart + read-back
            6335 * 3600 / 1024,  # frontier's node MTBF over 1,024 nodes
        ),
        rel=1e-12,
    )
    assert resolved.checkpointing.save_s == pytest.approx(
        BYTES_PER_ELEMENT * cfg.model.n_params() / (1024 * 0.467e9), rel=1e-12
    )


def test_a_machine_without_a_failure_rate_refuses_auto_and_predicts_nothing():
    off = ["machine.reliability.node_mtbf_hours=0"]
    with pytest.raises(ConfigError, match=r"^train\.checkpoint_every=auto: .*node_mtbf_hours"):
        resolve(load([*off, "train.checkpoint_every=auto"]))
    resolved = resolve(load([*off, "train.checkpoint_every=7"]))
    assert resolved.train.checkpoint_every == 7 and resolved.checkpointing is None


# --------------------------------------------------------------------------- site profiles


@pytest.mark.parametrize(
    "site,fs_gbps,nodes",
    [("frontier", 4600, 9856), ("perlmutter", 5000, 1792 + 3072), ("alps", 1090, 4008)],
)
def test_site_profiles_carry_cited_failure_rates_and_write_bandwidths(site, fs_gbps, nodes):
    machine = load([f"machine={site}"]).machine
    rel = machine.reliability
    assert rel.node_mtbf_hours == pytest.approx(LLAMA3_NODE_HOURS, abs=0.5)  # 6,334.7
    assert rel.write_gbps_per_node == pytest.approx(fs_gbps / nodes, rel=2e-3)
    assert "arxiv.org/abs/2407.21783" in machine.sources["reliability.node_mtbf_hours"]
    assert f"{fs_gbps:,}" in machine.sources["reliability.write_gbps_per_node"]


# --------------------------------------------------------------------------- plan


def test_plan_prints_the_interval_and_the_expected_goodput(capsys):
    assert plan_main([*FRONTIER_320B, "top=1", "output=json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    best = payload["plans"][0]
    cfg = load(FRONTIER_320B)
    steps = auto_steps(cfg, 1024, best["step_time_s"])
    ck = payload["checkpointing"]
    assert ck["auto_checkpoint_every"] == steps
    assert ck["checkpoint_every"] == 200  # gpt_320b's preset, as composed
    save, mtbf = ck["save_s"], 6335 * 3600 / 1024
    restart = restart_by_hand(1024) + save
    assert ck["job_mtbf_s"] == pytest.approx(mtbf) and ck["restart_s"] == pytest.approx(restart)
    assert ck["auto_expected_goodput"] == pytest.approx(
        first_order_goodput(steps * best["step_time_s"], save, restart, mtbf), rel=1e-12
    )
    assert ck["expected_goodput"] == pytest.approx(
        first_order_goodput(200 * best["step_time_s"], save, restart, mtbf), rel=1e-12
    )
    assert (
        0.5 < ck["auto_expected_goodput"] < 1
        and ck["auto_expected_goodput"] >= ck["expected_goodput"]
    )

    assert plan_main(FRONTIER_320B) == 0
    text = capsys.readouterr().out
    table = text.split("\njob start, ")[0].splitlines()[2:]
    assert table[0].startswith("rank ") and max(len(ln) for ln in table) <= 120
    (line,) = [ln for ln in text.splitlines() if ln.startswith("checkpoints of rank 1")]
    assert f"every {steps:,} steps = " in line and "(train.checkpoint_every=auto)" in line
    assert f"expected goodput {ck['auto_expected_goodput']:.1%}" in line
    assert f"with train.checkpoint_every=200 (as composed): {ck['expected_goodput']:.1%}" in line


def test_plan_prices_spare_nodes_against_the_goodput_they_buy(capsys):
    """10 node failures expected in 20,000 steps: 2 spares (and 2 restarts in place) take
    a fifth of them; every other one waits 2 h in the queue, as all do without spares."""
    args = [*FRONTIER_320B, "train.steps=20000", "recovery.spare_nodes=2", "queue_wait_h=2"]
    assert plan_main([*args, "top=1", "output=json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    ck, spares = payload["checkpointing"], payload["spares"]
    step_s, save, mtbf = ck["step_time_s"], ck["save_s"], ck["job_mtbf_s"]
    failures = 20000 * step_s / mtbf
    assert 5 < failures < 20  # so that the spares cover only some
    tau, restart = 200 * step_s, ck["restart_s"]
    with_ = first_order_goodput(tau, save, restart + (1 - 2 / failures) * 7200, mtbf)
    without = first_order_goodput(tau, save, restart + 7200, mtbf)
    assert spares["goodput_with"] == pytest.approx(with_, rel=1e-12)
    assert spares["goodput_without"] == pytest.approx(without, rel=1e-12)
    assert spares["spare_node_hours"] == pytest.approx(2 * 20000 * step_s / with_ / 3600)
    assert spares["restarted_on_a_spare"] == pytest.approx(2 / failures)
    assert 0 < without < with_ < 1

    assert plan_main(args) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("spares (")]
    assert f"{spares['spare_node_hours']:,.4g} node-h idle" in line, line
    assert f"{with_:.1%} with, {without:.1%} without" in line, line

    assert plan_main(["machine=local", "top=1", "output=json"]) == 0  # no scheduler: none
    assert json.loads(capsys.readouterr().out)["spares"] is None
    assert plan_main([*FRONTIER_320B, "queue_wait_h=soon"]) == 2
    assert "queue_wait_h='soon'" in capsys.readouterr().err


# --------------------------------------------------------------------------- launch summary


def summary_field(stdout: str, label: str) -> str:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(f"{label:<10} ")]
    return line[11:]


def test_the_summary_states_the_interval_and_the_job_gets_the_integer(tmp_path):
    args = [*FRONTIER_320B, "grid=auto", "train.data=synthetic", "dry_run=true"]
    proc = run_launcher([*args, "train.checkpoint_every=auto", f"hydra.run.dir={tmp_path / 'a'}"],
                        cwd=tmp_path, env=THIS_TREE)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = summary_field(proc.stdout, "checkpoint")
    m = re.fullmatch(r"every ([\d,]+) steps \(auto: Daly's .+ over ([\d.]+) s/step\); .+", line)
    assert m, line
    every = int(m[1].replace(",", ""))
    spec = json.loads((tmp_path / "a" / "spec.json").read_text())
    assert spec["train"]["checkpoint_every"] == every  # an integer, never "auto"
    assert f"checkpoint_every: {every}\n" in (tmp_path / "a" / "config.yaml").read_text()
    resolved = resolve(load([*args, "train.checkpoint_every=auto"]))
    assert every == resolved.train.checkpoint_every
    assert summary_field(proc.stdout, "goodput").startswith(
        f"{resolved.checkpointing.goodput:.1%} expected on frontier: job MTBF 6.2 h (6,335 h"
        " per node /"
        " 1,024 nodes)"
    )

    given = run_launcher([*args, f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, env=THIS_TREE)
    assert given.returncode == 0, given.stderr
    assert summary_field(given.stdout, "checkpoint").startswith(
        f"every 200 steps (train.checkpoint_every=200); auto: {every:,} "
    )
    assert f"({resolved.checkpointing.goodput:.1%} with train.checkpoint_every=auto)" in (
        summary_field(given.stdout, "goodput")
    )
    spec = json.loads((tmp_path / "b" / "spec.json").read_text())
    assert spec["train"]["checkpoint_every"] == 200


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,expected",
    [
        (["train.checkpoint_every=-3"], "train.checkpoint_every=-3: expected a number of steps"),
        (["train.checkpoint_every=abc"], "train.checkpoint_every='abc': expected a number of"),
        (["train.checkpoint_every=2.5"], "train.checkpoint_every=2.5: expected a number of"),
        (
            ["train.checkpoint_every=auto", "machine.reliability.node_mtbf_hours=0"],
            "train.checkpoint_every=auto: machine=local knows no failure rate",
        ),
        (["machine.reliability.write_gbps_per_node=0"], "write_gbps_per_node=0.0: must be > 0"),
        (["machine.reliability.node_mtbf_hours=-1"], "node_mtbf_hours=-1.0: must be >= 0"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_input_is_one_line_naming_the_field_and_what_is_valid(args, expected, tmp_path):
    result = run_launcher(args, cwd=tmp_path, env=THIS_TREE)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    if "checkpoint_every=" in args[0] and "auto" not in args[0]:
        assert "or auto" in lines[0]  # names what is valid
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == [], "something was written"
