"""This computer as a scheduler: the ranks are local processes under a supervisor
(``processes.py``), one node, no queue and no Slurm command. Its job ids are
``local-<supervisor pid>``; ``records/`` reads their states from the job dir."""

from __future__ import annotations

from axonn_launch.scheduler.base import Scheduler, register


class Local(Scheduler):
    name = "local"
    on_this_computer = True


LOCAL = register(Local())
