"""The one old module path a queued job can still need: ``axonn_launch.job.TrainJob``.

submitit pickles a job's callable by module path when it submits it, and Slurm runs a
requeued job from that pickle. A job submitted before the package moved into folders names
``axonn_launch.job.TrainJob``; this module gives it the class that now lives in
``submit/task.py`` (the same object), so such a job still runs when requeued. No other old
path was ever pickled (``tests/fixtures/trainjob_before_relayout.pkl``).

Removal: once no job submitted before the re-layout (commit be55d50) can be requeued on a
cluster, delete this module and the two tests that load the old pickle.
"""

from axonn_launch.submit.task import TrainJob

__all__ = ["TrainJob"]
