"""What runs once a job is launched: inside its allocation (a local run's supervisor,
``supervise.py``; the restart decision after a failed step, ``restart.py``; a packed sweep's
runner, ``pack_runner.py``) or after it ends (the recovery step, ``recovery.py``; a new
attempt, ``resubmit.py``, also from ``jobs resubmit``). The entries that batch scripts name
are the top-level ``axonn_launch.restart``, ``.recover`` and ``.pack``. Above ``submit/``
(what runs at launch); no torch.
"""
