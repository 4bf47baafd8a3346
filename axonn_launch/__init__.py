"""axonn_launch: 4D hybrid-parallel GPT training (AxoNN's algorithm) on Slurm machines."""

from axonn_launch import moved
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec

moved.install()  # old module paths (pickled jobs, users' scripts) still import

__all__ = ["Grid", "ModelSpec"]
__version__ = "0.1.0"
