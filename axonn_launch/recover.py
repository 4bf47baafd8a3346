"""``python -m axonn_launch.recover <attempt dir>``: the entry a recovery job's batch script
names (``submit/chain.py``), also in scripts already queued on a cluster; the process itself
is ``batch/recovery.py``. People need not call it."""

import sys

from axonn_launch.batch.recovery import main

if __name__ == "__main__":
    sys.exit(main())
