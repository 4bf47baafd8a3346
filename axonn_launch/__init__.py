"""axonn_launch: 4D hybrid-parallel GPT training (AxoNN's algorithm) on Slurm machines."""

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec

__all__ = ["Grid", "ModelSpec"]
__version__ = "0.1.0"
