"""Checkpoint format tags, as written in a checkpoint's ``meta.json``.

The login side (``export.py`` refuses or converts by format) and the job side (resume,
verification, the legacy reader) compare the same string, so it is spelled once, here.
"""

from __future__ import annotations

DCP_FORMAT = "dcp/1"  # torch.distributed.checkpoint, a folder per step (checkpoint/manager.py)
LEGACY_FORMAT = "per-rank-shards/1"  # one rank_NNNNN.pt per rank (train/checkpoint/legacy.py)
RESUMABLE_FORMATS = (DCP_FORMAT, LEGACY_FORMAT)  # what a run resumes from
