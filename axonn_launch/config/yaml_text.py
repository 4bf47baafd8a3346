"""YAML text as OmegaConf writes it, made with libyaml's emitter where the text is alike,
and a fast deep copy of a composed config: what each sweep point's job files cost."""

from __future__ import annotations

import copy
import functools
import pickle
import re
from typing import Any


def yaml_text(container: Any) -> str:
    """``OmegaConf.to_yaml`` of a plain container (dicts, lists, scalars): the same text,
    made with libyaml's emitter where PyYAML has it and the text is alike (a sweep point
    writes four)."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    dumper = omegaconf_dumper() if all_printable_ascii(container) else get_omega_conf_dumper()
    return yaml.dump(container, Dumper=dumper, default_flow_style=False, allow_unicode=True,
                     sort_keys=False)  # fmt: skip


PRINTABLE_ASCII = re.compile(r"[ -~]*")


def all_printable_ascii(container: Any) -> bool:
    """Whether every string of ``container`` (keys too) is printable ASCII on one line:
    libyaml folds a long double-quoted string (a newline, a tab, non-ASCII) unlike PyYAML,
    so such a text is made by PyYAML's emitter."""
    if isinstance(container, str):
        return PRINTABLE_ASCII.fullmatch(container) is not None
    if isinstance(container, dict):
        return all(all_printable_ascii(k) and all_printable_ascii(v) for k, v in container.items())
    if isinstance(container, list | tuple):
        return all(all_printable_ascii(v) for v in container)
    return True


def config_yaml_text(cfg: Any) -> str:
    """``OmegaConf.to_yaml(cfg)`` of a DictConfig or ListConfig (``yaml_text``)."""
    from omegaconf import OmegaConf

    return yaml_text(OmegaConf.to_container(cfg, resolve=False, enum_to_str=True))


def copy_config(cfg: Any) -> Any:
    """A deep copy of an OmegaConf config, by a pickle round trip: about three times as
    fast as ``copy.deepcopy`` for a composed config (the same config; deepcopy when a value
    does not pickle)."""
    try:
        return pickle.loads(pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return copy.deepcopy(cfg)


@functools.cache
def omegaconf_dumper() -> type:
    """OmegaConf's YAML dumper (quotes a string that reads as a bool or a number), on
    libyaml's emitter when PyYAML was built with it."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    dumper = get_omega_conf_dumper()
    base = yaml.CDumper if getattr(yaml, "__with_libyaml__", False) else dumper
    # no anchors: OmegaConf copies a value used twice, so its text repeats it
    fast = type("OmegaConfFastDumper", (base,), {"ignore_aliases": lambda self, data: True})
    fast.add_representer(str, dumper.str_representer)
    return fast
