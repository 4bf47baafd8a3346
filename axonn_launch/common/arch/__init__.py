"""The model architectures by name (``ModelSpec.arch``): one torch-free strategy each.

The cost model, the rules and the traffic model ask ``ModelSpec.architecture`` (an
``Architecture``, ``base.py``) rather than branching on the name. The job side builds the
torch module registered under the same name (``train/models/registry.py``). Adding an architecture:
its strategy here, its torch module there, a preset in ``conf/model/`` and tests
(``tests/common/test_arch_registry.py`` checks that every registered name has all four).
"""

from __future__ import annotations

from axonn_launch.common.arch.base import Architecture
from axonn_launch.common.arch.gpt import GPT
from axonn_launch.common.arch.llama import LLAMA

ARCHITECTURES: dict[str, Architecture] = {}


def register(architecture: Architecture) -> Architecture:
    """Add ``architecture`` under its name, which no other may hold."""
    if not architecture.name or architecture.name in ARCHITECTURES:
        raise ValueError(f"architecture name {architecture.name!r}: empty or already registered")
    ARCHITECTURES[architecture.name] = architecture
    return architecture


register(GPT)
register(LLAMA)
