"""The model architectures by name (``ModelSpec.arch``): where a new one is added.

Each entry builds the model from its spec with ``GPT``'s keyword arguments (groups,
overlap, seed...). ``Llama`` builds on ``GPT``'s blocks, so this registry sits above both
modules rather than in either.
"""

from __future__ import annotations

from collections.abc import Callable

from axonn_launch.common.models import ModelSpec
from axonn_launch.train.llama import Llama
from axonn_launch.train.model import GPT

ARCHITECTURES: dict[str, Callable[..., GPT]] = {
    "gpt": GPT,
    "llama": Llama,
}


def build_model(spec: ModelSpec, **kwargs) -> GPT:
    """The model of ``spec.arch`` (common/models.py's names), built with ``GPT``'s keyword
    arguments."""
    return ARCHITECTURES[spec.arch](spec, **kwargs)  # ModelSpec checked the name
