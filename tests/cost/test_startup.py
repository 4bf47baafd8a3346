"""The start-up model (``cost/startup.py``): its seconds against hand arithmetic from its
coefficients, the broadcast's phases only where the job broadcasts, the launch summary's
restart and ``plan`` showing it labelled, an explicit ``reliability.restart_s`` winning, a
site's own model replacing the package's, and a bad coefficient as one line. In-process,
login-node functions only."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import resolve
from axonn_launch.cost import startup
from axonn_launch.plan import main as plan_main
from axonn_launch.submit.summary import goodput_words
from tests.conftest import REPO

# A site's own model, as a profile (or an override) gives it: one phase of each form
SITE = (
    "+machine.reliability.startup={label: measured, nodes: [16, 256], source: site runs,"
    " phases: {queue: {form: constant, a: 2},"
    " copy: {form: linear, a: 1, b: 0.5, broadcast: true},"
    " fanout: {form: n_log_n, a: -3, b: 0.25},"
    " store: {form: quadratic, a: 0, b: 0.001}}}"
)


def by_hand(nodes: int, broadcast: bool) -> dict[str, float]:
    """SITE's phases at ``nodes``, written out: a + b * f(N)."""
    seconds = {"queue": 2.0, "fanout": -3 + 0.25 * nodes * math.log2(nodes),
               "store": 0.001 * nodes * nodes}  # fmt: skip
    if broadcast:
        seconds["copy"] = 1 + 0.5 * nodes
    return seconds


def test_a_sites_model_is_its_coefficients_by_hand_with_the_broadcast_where_it_runs():
    machine = load(["machine=frontier", SITE]).machine  # broadcasts from 16 nodes
    up = startup.startup(machine, 64)
    assert up.site and up.seconds == pytest.approx(by_hand(64, broadcast=True), rel=1e-12)
    # 2 + (1 + 32) + (-3 + 0.25 * 64 * 6) + 0.001 * 4096 = 2 + 33 + 93 + 4.096
    assert up.total_s == pytest.approx(132.096, rel=1e-12)
    assert up.basis() == "fitted to measured runs of 16-256 nodes" and not up.extrapolated
    small = startup.startup(machine, 8)  # below 16 nodes: no broadcast
    assert small.seconds == pytest.approx(by_hand(8, broadcast=False), rel=1e-12)
    assert small.seconds["fanout"] == pytest.approx(3.0)  # -3 + 0.25 * 8 * 3
    assert startup.startup(machine, 2).seconds["fanout"] == 0.0  # -3 + 0.5: never below 0
    off = load(["machine=frontier", SITE, "machine.python_broadcast=false"]).machine
    assert "copy" not in startup.startup(off, 64).seconds
    big = startup.startup(machine, 4096)
    assert big.extrapolated and big.words().endswith(
        "at 4,096 nodes, extrapolated from measured runs of 16-256 nodes"
    )
    assert big.as_dict()["label"] == "extrapolated"
    assert big.as_dict()["from"] == "machine.reliability.startup"


def test_the_packaged_model_is_its_files_coefficients_by_hand():
    """Frontier at 1,024 nodes (it broadcasts): each phase of conf/startup.yaml."""
    raw = yaml.safe_load((REPO / "axonn_launch" / "conf" / "startup.yaml").read_text())
    n = 1024
    f = {"constant": 0, "linear": n, "n_log_n": n * 10, "quadratic": n * n}  # log2 1024 = 10
    hand = {name: p["a"] + p.get("b", 0) * f[p["form"]] for name, p in raw["phases"].items()}
    up = startup.startup(load(["machine=frontier"]).machine, n)
    assert not up.site and up.seconds == pytest.approx(hand, rel=1e-12)
    assert up.words() == (
        f"start-up {startup.duration(sum(hand.values()))} at 1,024 nodes,"
        " extrapolated from emulated runs of 8-512 nodes"
    )
    alps = startup.startup(load(["machine=alps"]).machine, n)  # the container: no broadcast
    assert set(alps.seconds) == {k for k, p in raw["phases"].items() if not p.get("broadcast")}


def test_the_summarys_restart_is_detection_plus_start_up_unless_restart_s_is_set():
    args = ["machine=frontier", "model=gpt_5b", "nodes=128", "train.data=synthetic"]
    cfg = load([*args, "dry_run=true"])
    ck = resolve(cfg).checkpointing
    up = startup.startup(cfg.machine, 128)
    assert ck.restart_s == pytest.approx(600 + up.total_s + ck.save_s, rel=1e-12)
    words = goodput_words(ck, cfg)
    assert f"(detection 10 min + {up.words()}, + the read-back " in words, words
    assert "at 128 nodes, fitted to emulated runs of 8-512 nodes" in words

    given = load([*args, "dry_run=true", "+machine.reliability.restart_s=900"])
    ck = resolve(given).checkpointing
    assert ck.restart_s == pytest.approx(900 + ck.save_s, rel=1e-12) and ck.restart.startup is None
    assert "(machine.reliability.restart_s as set: the start-up model not used" in (
        goodput_words(ck, given)
    )


def test_plan_shows_the_start_up_at_its_node_count_and_around_it(capsys):
    args = ["machine=frontier", "model=gpt_5b", "nodes=256", "top=1"]
    assert plan_main([*args, "output=json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    up = startup.startup(load(["machine=frontier"]).machine, 256)
    assert payload["startup"]["seconds"] == pytest.approx(up.total_s, rel=1e-12)
    assert payload["startup"]["phases"] == pytest.approx(up.seconds, rel=1e-12)
    assert payload["checkpointing"]["restart"]["startup"]["nodes"] == 256
    machine = load(["machine=frontier"]).machine
    around = {n: startup.startup(machine, n) for n in (64, 128, 256, 512, 1024)}
    assert payload["startup"]["by_nodes"] == pytest.approx(
        {str(n): s.total_s for n, s in around.items()}, rel=1e-12
    )
    assert plan_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    line, by_nodes = [ln for ln in out if ln.startswith("start-up")]
    assert line.startswith(up.words()) and "broadcast_unpack " in line
    assert by_nodes == "start-up by node count: " + ", ".join(
        f"{n:,} nodes {startup.duration(s.total_s)} ("
        + ("extrapolated" if n > 512 else "fitted, emulated")
        + ")"
        for n, s in around.items()
    )  # 8-512 nodes measured: 1,024 beyond them
    assert plan_main(["machine=local", "top=1", "output=json"]) == 0  # no batch job here
    assert json.loads(capsys.readouterr().out)["startup"] is None


@pytest.mark.parametrize(
    "phase,message",
    [
        ("{form: cubic, a: 1}", "phases.x.form='cubic': expected one of constant, linear,"
         " n_log_n, quadratic"),
        ("{form: linear, a: 1, b: -2}", "phases.x.b=-2.0: expected a finite number >= 0"),
        ("{form: linear, a: nan}", "phases.x.a=nan: expected a finite number of seconds"),
    ],
)  # fmt: skip
def test_a_bad_coefficient_is_one_line_naming_it(phase, message):
    with pytest.raises(ConfigError) as err:
        load(["machine=frontier",
              f"+machine.reliability.startup={{nodes: [8], phases: {{x: {phase}}}}}"])  # fmt: skip
    text = str(err.value)
    assert f"machine.reliability.startup.{message}" in text and "\n" not in text, text


def test_the_packaged_model_is_the_start_up_benchs_fits():
    """conf/startup.yaml is what bench/scale/startup_model.py makes of the committed
    bench/results/scale.json: a new measurement gives a new model, with no hand refit."""
    from bench.scale import startup_model

    assert startup_model.main(["--check"]) == 0
