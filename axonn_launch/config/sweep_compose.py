"""One composition shared by a sweep's points: points that differ only in values compose
once, each a copy of that composition with its values applied; and Hydra's per-job copies
and ``.hydra/*.yaml`` made faster (``cli.main`` uses both while Hydra runs)."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from axonn_launch.config.compose import compose
from axonn_launch.config.overrides import composition_error, parse_overrides
from axonn_launch.config.schema import ConfigError
from axonn_launch.config.site import CONFIG_MODULE
from axonn_launch.config.yaml_text import config_yaml_text, copy_config


def split_values(parsed: list, is_group: Callable[[str], bool]) -> tuple[list, list]:
    """A point's parsed overrides as (those that decide the composition, value overrides).
    A value override (``train.lr=0.1``) only changes one key of the composed tree, so
    points that differ only in values share one composition. Anything else (a group
    choice, ``+``/``~``/``++``, a Hydra key, a package, a sweep) decides the composition;
    with another config dir (``hydra.searchpath``) every override does."""
    if any(o.key_or_group.startswith("hydra.searchpath") for o in parsed):
        return list(parsed), []
    structural, values = [], []
    for override in parsed:
        key = override.key_or_group
        plain = override.type.name == "CHANGE" and override.package is None
        plain = plain and not override.is_sweep_override() and not override.is_hydra_override()
        is_value = plain and "/" not in key and not is_group(key)
        (values if is_value else structural).append(override)
    return structural, values


@functools.cache
def is_config_group(key: str) -> bool:
    """Whether ``key`` names a config group of the package's ``conf/`` (``machine``)."""
    return resources.files(CONFIG_MODULE).joinpath(key).is_dir()


def apply_values(values: list, tree: Any) -> None:
    """Apply value overrides to a composed tree, as Hydra does after composing."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(values, tree)


class SharedComposition:
    """The argument check's composition of a sweep's points: one ``compose`` per distinct
    set of overrides that decide the composition (``split_values``), each point a copy of
    it with its own values applied. 500 points of ``train.lr=...`` compose once."""

    def __init__(self) -> None:
        self.bases: dict[tuple[str, ...], Any] = {}

    def tree(self, point: list[str]) -> Any:
        """The composed tree of ``point``, as ``compose(point)`` gives it."""
        structural, values = split_values(parse_overrides(point), is_config_group)
        key = tuple(o.input_line for o in structural)
        if key not in self.bases:
            self.bases[key] = compose(list(key))
        tree = copy_config(self.bases[key])
        try:
            apply_values(values, tree)
        except Exception as exc:
            raise ConfigError(composition_error(point, exc)) from exc
        return tree


@contextlib.contextmanager
def shared_sweep_composition() -> Iterator[None]:
    """While in use, Hydra composes each sweep point (``load_sweep_config``) from one
    composition per distinct set of overrides that decide it (``SweepBases``), copied with
    the point's values applied and its ``hydra.overrides.task`` and ``override_dirname``
    set as Hydra sets them. Hydra's check of a batch before launching it composes only
    those bases: the argument check (``cli.check_arguments``) applied each point's values."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.plugins.sweeper import Sweeper

    original = ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal
    bases = SweepBases(original[0])

    def load_sweep_config(self: Any, master_config: Any, sweep_overrides: list[str]) -> Any:
        parsed = parse_overrides(sweep_overrides)
        base, values = bases.base(self, master_config, parsed)
        return point_of_base(base, master_config, parsed, values)

    def validate_batch_is_legal(sweeper: Any, batch: Any) -> None:
        for overrides in batch:
            bases.base(sweeper.hydra_context.config_loader, sweeper.config,
                       parse_overrides(list(overrides)))  # fmt: skip

    ConfigLoaderImpl.load_sweep_config = load_sweep_config
    Sweeper.validate_batch_is_legal = validate_batch_is_legal
    try:
        with interpolations_parsed_once():
            yield
    finally:
        ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal = original


@contextlib.contextmanager
def interpolations_parsed_once() -> Iterator[None]:
    """While in use, OmegaConf parses each interpolation text once (its grammar's parse,
    ``omegaconf.grammar_parser.parse``, which resolving a point's config repeats for every
    ``${...}`` of every point); a parse tree is read, never changed, by its resolution."""
    from omegaconf import _utils, base

    original = base.parse, _utils.parse
    cached = functools.lru_cache(maxsize=4096)(original[0])
    base.parse = _utils.parse = cached
    try:
        yield
    finally:
        base.parse, _utils.parse = original


@dataclass
class SweepBases:
    """Hydra's compositions of a sweep, one per distinct set of overrides that decide it."""

    compose: Callable[..., Any]  # Hydra's own ``load_sweep_config``
    found: dict[tuple, Any] = field(default_factory=dict)

    def base(self, loader: Any, master_config: Any, parsed: list) -> tuple[Any, list]:
        """The shared composition of a point's ``parsed`` overrides, and its values."""
        groups = set(master_config.hydra.runtime.choices)  # the run's config groups
        structural, values = split_values(parsed, groups.__contains__)
        lines = [o.input_line for o in structural]
        key = (id(master_config), *lines)
        if key not in self.found:
            self.found[key] = self.compose(loader, master_config, lines)
        return self.found[key], values


def point_of_base(base: Any, master_config: Any, parsed: list, values: list) -> Any:
    """A sweep point's config: a copy of its shared composition with its values applied."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    cfg = copy_config(base)
    task = [o for o in parsed if not o.is_hydra_override()]
    try:
        apply_values(values, cfg)
    except OmegaConfBaseException as exc:
        raise ConfigCompositionException(str(exc)) from exc
    dirname = cfg.hydra.job.config.override_dirname
    with open_dict(cfg.hydra):
        cfg.hydra.overrides.task = [o.input_line for o in task]
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=task, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep,
            exclude_keys=dirname.exclude_keys,
        )  # fmt: skip
        if cfg.get("dry_run") is True:
            cfg.hydra.output_subdir = None  # a dry run's point: no .hydra/*.yaml (docs/launch.md)
    OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
    return cfg


@contextlib.contextmanager
def hydra_job_copies_and_yaml() -> Iterator[None]:
    """While in use, Hydra's ``run_job`` copies a job's config with ``job_copy``, sets
    its ``HydraConfig`` with ``set_hydra_config`` and writes its ``.hydra/*.yaml`` with
    ``config_yaml_text``: the same copies and files, made faster (they were about half of
    a dry-run sweep point)."""
    from hydra.core import utils
    from hydra.core.hydra_config import HydraConfig

    original = utils._save_config, utils.copy, HydraConfig.set_config

    def save_config(cfg: Any, filename: str, output_dir: Any) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(str(output_dir / filename), "w", encoding="utf-8") as file:
            file.write(config_yaml_text(cfg))

    utils._save_config = save_config
    utils.copy = types.SimpleNamespace(deepcopy=job_copy)  # run_job's only use of copy
    HydraConfig.set_config = set_hydra_config
    try:
        yield
    finally:
        utils._save_config, utils.copy, HydraConfig.set_config = original


def set_hydra_config(self: Any, cfg: Any) -> None:
    """Hydra's ``HydraConfig.set_config`` without its copy: the ``hydra`` node made read-only
    and put alone under a new root, still a child of ``cfg`` (so that the user's config may
    interpolate it). Hydra copies the node (``OmegaConf.masked_copy``) twice per job; a
    read-only node is not changed after (``run_job`` sets its ``output_dir`` between its two
    calls, as it is meant to show), so sharing it shows the same values."""
    from hydra.conf import HydraConf
    from omegaconf import DictConfig, OmegaConf, flag_override

    OmegaConf.set_readonly(cfg.hydra, True)
    assert issubclass(OmegaConf.get_type(cfg, "hydra"), HydraConf)
    node = cfg._get_node("hydra")
    masked = DictConfig(content={})
    with flag_override(masked, "no_deepcopy_set_nodes", True):
        masked.hydra = node
    node._set_parent(cfg)
    self.cfg = masked


def job_copy(cfg: Any) -> Any:
    """``run_job``'s ``copy.deepcopy``: of the ``HydraConfig`` just set for this job
    (``set_hydra_config``), which is never changed, itself; of the job's config, which
    ``run_job`` copies only to delete its ``hydra`` node, a copy of the rest (``task_copy``)."""
    from hydra.core.hydra_config import HydraConfig

    if cfg is HydraConfig.instance().cfg:
        return cfg
    return task_copy(cfg)


def task_copy(cfg: Any) -> Any:
    """A copy of a job's config with an empty ``hydra`` node in place of its own: the copy
    ``run_job`` deletes ``hydra`` from at once (its ``task_cfg``), without copying that node,
    half of the tree, first. ``copy_config`` of any other config."""
    from omegaconf import DictConfig, open_dict

    content = cfg.__dict__.get("_content") if isinstance(cfg, DictConfig) else None
    if not isinstance(content, dict) or "hydra" not in content:
        return copy_config(cfg)
    cfg.__dict__["_content"] = {k: v for k, v in content.items() if k != "hydra"}
    try:
        copied = copy_config(cfg)
    finally:
        cfg.__dict__["_content"] = content
    with open_dict(copied):
        copied["hydra"] = {}
    return copied
