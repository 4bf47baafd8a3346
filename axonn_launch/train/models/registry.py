"""The torch module of each architecture, keyed by the names of ``common/arch``'s registry.

Each entry builds the model from its spec with ``GPT``'s keyword arguments (groups,
overlap, seed...). ``Llama`` builds on ``GPT``'s blocks, so this registry sits above both
modules rather than in either. A new architecture registers its strategy in
``common/arch`` and its module here (``register_model``).
"""

from __future__ import annotations

from collections.abc import Callable

from axonn_launch.common.arch import ARCHITECTURES, GPT, LLAMA
from axonn_launch.common.models import ModelSpec
from axonn_launch.train.models.gpt import GPT as GPTModule
from axonn_launch.train.models.llama import Llama

MODELS: dict[str, Callable[..., GPTModule]] = {}


def register_model(name: str, module: Callable[..., GPTModule]) -> None:
    """Build ``module`` for the architecture ``name``, whose strategy must be registered."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {name!r}: no strategy registered in common/arch"
            f" (registered: {', '.join(ARCHITECTURES)})"
        )
    MODELS[name] = module


def build_model(spec: ModelSpec, **kwargs) -> GPTModule:
    """The model of ``spec.arch``, built with ``GPT``'s keyword arguments."""
    if spec.arch not in MODELS:
        raise ValueError(
            f"model.arch={spec.arch!r}: no torch module registered in train/models/registry.py"
        )
    return MODELS[spec.arch](spec, **kwargs)


register_model(GPT.name, GPTModule)
register_model(LLAMA.name, Llama)
