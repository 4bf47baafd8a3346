"""The fork server's last preload (``tests/train/dist_utils.py``): importing this module
ends the preload as ``axonn_launch.train.zygote.preload`` ends a local job's, so that a
test rank starts as a local job's rank does. The objects the imports made are frozen
(no rank's garbage collection scans them again), and torch.library's operator
registrations are not undone at each rank's exit (about 0.13 CPU-s a rank)."""

import gc

from axonn_launch.train.zygote import keep_registrations_at_exit

keep_registrations_at_exit()
gc.freeze()
