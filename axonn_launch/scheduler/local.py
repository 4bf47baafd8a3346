"""This computer as a scheduler: the ranks are local processes under a supervisor
(``processes.py``), one node, no queue and no Slurm command. Its job ids are
``local-<supervisor pid>``; ``records/`` reads their states from the job dir."""

from __future__ import annotations

import shlex

from axonn_launch.scheduler.base import Scheduler, register


class Local(Scheduler):
    name = "local"
    on_this_computer = True

    def run_text(self, command: list[str], world_size: int) -> str:
        return (
            f"# {world_size} local processes, each with RANK, WORLD_SIZE, LOCAL_RANK,"
            f" MASTER_ADDR, MASTER_PORT set:\n{shlex.join(command)}"
        )


LOCAL = register(Local())
