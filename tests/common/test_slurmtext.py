"""The Slurm text rules: host lists, job states, sacct and squeue output."""

from datetime import datetime
from pathlib import Path

import pytest

from axonn_launch.common import slurmtext
from axonn_launch.common.slurmtext import (
    JobRow,
    base_state,
    expand_hostlist,
    expand_nodelist,
    is_active,
    parse_sacct,
    parse_squeue,
)
from axonn_launch.records import failures
from axonn_launch.scheduler import slurm_jobs, slurm_queries

BOOTSTRAP = Path(slurmtext.__file__).parents[1] / "train" / "parallel" / "bootstrap.py"


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("nid[001234-001236,001240]", ["nid001234", "nid001235", "nid001236", "nid001240"]),
        ("a1,b[3,5-6]", ["a1", "b3", "b5", "b6"]),
        ("x1000c0s0b0n[0-1],login7", ["x1000c0s0b0n0", "x1000c0s0b0n1", "login7"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("r[1-2]-n[08-09],gpu01", ["r1-n08", "r1-n09", "r2-n08", "r2-n09", "gpu01"]),
        ("nid[8-11]", ["nid8", "nid9", "nid10", "nid11"]),
        ("nid[098-100]", ["nid098", "nid099", "nid100"]),
        ("n[7,01-02]", ["n7", "n01", "n02"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[3-1]", "n[a-b]", "n[[1-2]]", "n[1-]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_nodelist_field_of_a_job_without_nodes_is_empty():
    for text in ("", "None assigned", "(null)", "None"):
        assert expand_nodelist(text) == ()
    assert expand_nodelist("rack[1-2]-n[01-02]") == (
        "rack1-n01",
        "rack1-n02",
        "rack2-n01",
        "rack2-n02",
    )


def test_launcher_failures_and_job_side_share_one_expansion():
    # failures and bootstrap read the names of slurmtext, not copies of the rule
    assert failures.expand_nodelist is slurmtext.expand_nodelist
    # (the job side is read, not imported: importing it pulls in torch)
    source = BOOTSTRAP.read_text()
    assert "from axonn_launch.common.slurmtext import expand_hostlist" in source
    assert "def expand_hostlist" not in source and "def _expand" not in source
    assert failures.ACTIVE_STATES is slurmtext.ACTIVE_STATES
    assert failures.base_state is slurmtext.base_state
    assert not hasattr(slurm_jobs, "ACTIVE_STATES")


@pytest.mark.parametrize(
    ("state", "base"),
    [
        ("CANCELLED by 0", "CANCELLED"),
        ("CANCELLED by 1234", "CANCELLED"),
        ("RUNNING+", "RUNNING"),
        ("completed", "COMPLETED"),
        ("", ""),
        ("  ", ""),
    ],
)
def test_base_state(state, base):
    assert base_state(state) == base


@pytest.mark.parametrize(
    "state",
    [
        "PENDING",
        "RUNNING",
        "REQUEUE_HOLD",
        "REQUEUED",
        "REQUEUE_FED",
        "RESV_DEL_HOLD",
        "SUSPENDED",
        "CONFIGURING",
        "COMPLETING",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    ],
)
def test_states_of_a_job_not_over_yet_are_active(state):
    assert is_active(state)
    assert failures.classify(failures.Evidence(state=state)).failure == failures.RUNNING


@pytest.mark.parametrize(
    "state",
    ["COMPLETED", "FAILED", "CANCELLED by 0", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", ""],
)
def test_ended_states_are_not_active(state):
    assert not is_active(state)


def test_parse_sacct_allocation_lines():
    ended = "2026-12-03T06:30:01|2026-12-03T06:30:05|2026-12-03T06:31:05"
    text = (
        f"101|COMPLETED|0:0|n[1-2]|{ended}\n"
        "102|CANCELLED by 0|0:15|n1|2026-12-03T06:30:01|None|2026-12-03T06:30:09\n"
        "103|PENDING|0:0|None assigned|2026-12-03T06:30:01|Unknown|Unknown\n"
    )
    rows = parse_sacct(text)
    submit = datetime(2026, 12, 3, 6, 30, 1).timestamp()
    assert rows["101"] == JobRow("COMPLETED", "0:0", "n[1-2]", (submit, submit + 4, submit + 64))
    assert rows["102"] == JobRow("CANCELLED by 0", "0:15", "n1")  # never started: no times
    assert rows["103"] == JobRow("PENDING", "0:0", "None assigned")
    assert parse_sacct("104|FAILED|1:0|n1\n") == {"104": JobRow("FAILED", "1:0", "n1")}


def test_parse_sacct_skips_lines_of_another_shape():
    assert parse_sacct("\n101|COMPLETED|0:0\nsacct: error: something\n") == {}


def test_parse_squeue():
    text = "7|RUNNING|n[1-2]\n8|PENDING|\n"
    assert parse_squeue(text) == {
        "7": JobRow("RUNNING", "", "n[1-2]"),
        "8": JobRow("PENDING", "", ""),
    }


def test_sacct_and_squeue_commands_ask_for_what_the_parsers_read():
    command = slurm_queries.sacct_command(["1", "2"])
    assert command[command.index("-o") + 1] == "JobID,State,ExitCode,NodeList,Submit,Start,End"
    assert command[-2:] == ["-j", "1,2"] and "-P" in command and "-X" in command
    assert slurm_queries.squeue_command()[-1] == "%i|%T|%N"


@pytest.mark.parametrize(
    ("state", "down"),
    [
        ("idle", False),
        ("alloc", False),
        ("mix-", False),  # planned by the backfill scheduler: still up
        ("idle~", False),  # powered off: Slurm powers it up for a job
        ("down", True),
        ("DOWN", True),
        ("drain*", True),  # not responding as well
        ("drng@", True),
        ("down~", True),
        ("fail#", True),
        ("maint$", True),
        ("unk*", True),
        ("no_respond", True),
        ("down*~", True),  # several flags
        ("idle*", False),  # not responding, but not a down state by itself
        ("drained", False),  # sinfo's %t is short: the long name is not its %t
        ("", False),
    ],
)
def test_a_node_state_is_down_whatever_flags_follow_it(state, down):
    assert slurmtext.node_down(state) is down
