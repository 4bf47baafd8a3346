"""Hydra composes; this module turns the composed tree into typed dataclasses, once.

Everything below ``to_launch_config`` takes plain dataclasses. Errors are
``ConfigError`` with a one-line message naming the field, the value and what would
be valid.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import pickle
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from axonn_launch import scheduler
from axonn_launch.common.jobdir import CheckpointMissing, read_step_meta, resolve_checkpoint
from axonn_launch.common.machine import MachineProfile, kind_problem, required_problem
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GenerateConfig, MemorizationConfig, TrainConfig
from axonn_launch.common.tracking import MetricsConfig

CONFIG_MODULE = "axonn_launch.conf"


class ConfigError(ValueError):
    """A bad input, reported as one line; nothing has been submitted or written."""


@dataclass(frozen=True)
class GridRequest:
    """The grid as asked for: unset axes are None; ``auto`` asks the planner."""

    data: int | None = None
    x: int | None = None
    y: int | None = None
    z: int | None = None
    auto: bool = False
    pick: int = 0  # with auto: 0 = the planner's best, k = its (k+1)-th best

    def given(self) -> bool:
        return any(getattr(self, a) is not None for a in ("data", "x", "y", "z"))


@dataclass(frozen=True)
class Site:
    accounts: dict[str, str] = field(default_factory=dict)
    scratch: str = ""


def account_override(site: Site, machine: str) -> str:
    """The override that sets ``machine``'s account: ``site.accounts.NAME=`` where the site
    config lists the machine, else ``+site.accounts.NAME=`` (Hydra adds a key only with +)."""
    return f"{'' if machine in site.accounts else '+'}site.accounts.{machine}"


@dataclass(frozen=True)
class RecoveryConfig:
    """How a failed attempt is brought back (conf/recovery/, submit/recovery.py)."""

    mode: str = "auto"  # auto: on for Slurm machines, off for local; on: every machine; off
    # class -> resume|resume_exclude|stop (and rollback for non_finite)
    policy: dict[str, str] = field(default_factory=dict)
    max_attempts: int = 5
    max_same_class: int = 3
    max_no_progress: int = 3  # attempts in a row whose checkpointed step did not advance
    exclude_stragglers: bool = False  # also leave out the nodes stragglers.json names
    backoff_s: float = 30.0
    budget_h: float = 0.0  # 0: no wall-clock budget
    on_fewer_nodes: str = "shrink"  # shrink | wait | stop
    notify: str = ""  # a command: <notify> <run dir> <state>
    in_job_restarts: int = 2  # a failed step run again inside its Slurm job (submit/in_job.py)
    spare_nodes: int = 0  # nodes asked beyond the grid's, taken by a restart in place


@dataclass(frozen=True)
class SweepConfig:
    """How a multirun's points use the scheduler (``submit/pack.py``)."""

    pack: str = "off"  # off | auto | <nodes>: points share allocations of that many nodes
    pack_time_min: int | None = None  # a pack's time limit; None: the machine's for its nodes
    array_limit: int = 0  # sweep.pack=array: tasks running at once (--array=...%N); 0: any


@dataclass(frozen=True)
class LaunchConfig:
    name: str
    machine: MachineProfile
    model: ModelSpec
    grid: GridRequest
    train: TrainConfig
    nodes: int | None = None
    dry_run: bool = False
    show_config: bool = False  # a dry run also prints the resolved config (summary.dry_run_text)
    wait: bool | None = None
    max_requeue: int = 3
    force: bool = False  # launch beside an identical queued or running job (submit/duplicates.py)
    resume: bool = False  # continue its job dir's run as a new attempt (submit/dirguard.py)
    site: Site = field(default_factory=Site)
    objective: str = "val_loss"  # what a sweep point returns to an optimizer (sweep.py)
    # check GEMM speed, bandwidth and network plugin in the allocation before training
    # (train/health/preflight.py); None = the machine's default: on for Slurm machines
    preflight: bool | None = None
    # copy the package into the job dir at submission, and have every attempt import that
    # copy (records/provenance.py); None = on for Slurm machines. Off on this computer: a
    # local job's supervisor has imported the installed package before the job is composed
    code_snapshot: bool | None = None
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    memorization: MemorizationConfig = field(default_factory=MemorizationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # curves (common/tracking.py)
    # run this site machine's batch script on the local Slurm cluster (rehearse.py)
    rehearse: bool = False
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    # auto: inside a held Slurm allocation (salloc), run as its step; new: submit a new job
    # (submit/allocation.py)
    allocation: str = "auto"
    sweep: SweepConfig = field(default_factory=SweepConfig)


ALLOCATIONS = ("auto", "new")

# Overrides that a point's name leaves out: already in the name, or not about the run.
UNNAMED_KEYS = (
    "machine", "model", "name", "dry_run", "wait", "nodes", "objective", "preflight", "study",
    "scale", "rehearse", "recovery", "force", "resume", "show_config",
    "allocation", "metrics", "sweep", "code_snapshot",
)  # fmt: skip
NAME_MAX = 80


def point_suffix() -> str:
    """``-x2-z1`` for a sweep point run with ``grid.x=2 grid.z=1``; ``""`` outside a
    sweep. The ``axonn_point`` resolver of ``name`` in conf/config.yaml, so that every
    point of a sweep has its own job name and directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    parts = []
    for override in HydraConfig.get().overrides.task:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra") or key.split(".")[0] in UNNAMED_KEYS or not value:
            continue
        parts.append(key.rsplit(".", 1)[-1] + re.sub(r"[^\w.+-]", "_", value))
    return ("-" + "-".join(parts))[:NAME_MAX] if parts else ""


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("axonn_point"):
        OmegaConf.register_new_resolver("axonn_point", point_suffix)
    if not OmegaConf.has_resolver("axonn_machines"):  # --help's list (conf/config.yaml)
        OmegaConf.register_new_resolver("axonn_machines", machine_choices)
    register_site_path()


# --- the site's own directory (docs/site.md) -------------------------------------------------

SITE_ENV = "AXONN_SITE_DIR"  # a directory of machine/<name>.yaml and local/default.yaml


def site_dir() -> Path | None:
    """The site directory ``AXONN_SITE_DIR`` names, absolute; None when unset. A value that is
    not a directory is a ConfigError naming it."""
    import os

    value = os.environ.get(SITE_ENV, "")
    if not value:
        return None
    path = Path(value).expanduser().absolute()
    if not path.is_dir():
        raise ConfigError(
            f"{SITE_ENV}={value!r}: not a directory; valid: a directory holding"
            " machine/<name>.yaml and local/default.yaml (docs/site.md), or unset"
        )
    return path


@contextlib.contextmanager
def using_site(path: str | None) -> Iterator[None]:
    """``AXONN_SITE_DIR`` set to ``path`` (None: unset) for the block, then as it was: a
    resubmission composes with the site its job was launched with (job.json ``site_dir``)."""
    import os

    before = os.environ.get(SITE_ENV)
    _set_env(SITE_ENV, path)
    try:
        yield
    finally:
        _set_env(SITE_ENV, before)


def _set_env(name: str, value: str | None) -> None:
    import os

    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def site_record() -> str | None:
    """The site directory as job.json records it (``site_dir``); None without one."""
    path = site_dir()
    return str(path) if path else None


@functools.cache
def register_site_path() -> None:
    """Put the site directory on Hydra's search path, before the package's ``conf/``, for
    every composition of this process: the launcher's, its sweeps' and ``compose``'s. A
    site's ``machine/frontier.yaml`` replaces the packaged one of that name."""
    from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    class SiteSearchPath(SearchPathPlugin):
        def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
            try:
                path = site_dir()
            except ConfigError:
                return  # compose() and the unknown-machine line say so
            if path is not None:
                search_path.prepend(SITE_ENV, f"file://{path}", SearchPathQuery(provider="main"))

    Plugins.instance().register(SiteSearchPath)


def compose(overrides: list[str]):
    """Compose the config tree with Hydra's compose API (tests, the argument check, tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    register_resolvers()
    site_dir()  # a site directory that is not one: one line, before Hydra's warnings
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides),
                                return_hydra_config=True)  # fmt: skip
    except Exception as exc:  # Hydra/OmegaConf errors become one line
        raise ConfigError(composition_error(overrides, exc)) from exc
    finally:
        GlobalHydra.instance().clear()
    check_profile(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


# --- the machine profile's schema (common/machine.py profile_problem), named by its file -----


def check_profile(cfg: Any) -> None:
    """Check the machine profile of a composed tree that still holds its ``hydra`` node: a
    missing or mistyped key, or a value of the wrong type, is one line naming the file."""
    from omegaconf import OmegaConf

    where = profile_file(cfg.hydra.runtime)
    try:
        raw = OmegaConf.to_container(cfg.machine, resolve=False)
        checked_profile(raw, lambda: OmegaConf.to_container(cfg.machine, resolve=True))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except Exception as exc:  # an interpolation that does not resolve
        raise ConfigError(f"{where}: {_first_line(exc)}") from None


def checked_profile(raw: dict, resolved: Callable[[], dict]) -> MachineProfile:
    """The profile of ``raw`` (as written) once checked: the keys of every profile, then
    unknown keys and types (``build`` of ``resolved()``, its interpolations resolved), then
    the keys its kind of machine needs."""
    problem = required_problem(raw)
    if problem:
        raise ConfigError(problem)
    profile = build(MachineProfile, resolved(), "machine")
    problem = kind_problem(raw)
    if problem:
        raise ConfigError(problem)
    return profile


def profile_file(runtime: Any) -> str:
    """The file of the run's machine profile (``runtime``: Hydra's ``hydra.runtime``): the
    first of its config sources that holds ``machine/<choice>.yaml``."""
    relative = f"machine/{runtime.choices.get('machine', DEFAULT_MACHINE)}.yaml"
    for source in runtime.config_sources:
        if source.schema == "file" and (Path(source.path) / relative).is_file():
            return str(Path(source.path) / relative)
        packaged = source.schema == "pkg" and source.path == CONFIG_MODULE
        if packaged and resources.files(CONFIG_MODULE).joinpath(relative).is_file():
            return f"{CONFIG_MODULE.replace('.', '/')}/{relative}"
    return relative


# --- one composition shared by a sweep's points ---------------------------------------------


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


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of ``overrides`` (a ConfigError naming the one that does not parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:
        raise ConfigError(composition_error(overrides, exc)) from exc


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
        yield
    finally:
        ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal = original


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
    OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
    return cfg


# --- YAML text as OmegaConf writes it, with libyaml's emitter --------------------------------


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


@contextlib.contextmanager
def hydra_job_copies_and_yaml() -> Iterator[None]:
    """While in use, Hydra's ``run_job`` copies a job's config with ``copy_config`` and
    writes its ``.hydra/*.yaml`` with ``config_yaml_text``: the same copies and files,
    made faster (they were about half of a dry-run sweep point)."""
    from hydra.core import utils

    original = utils._save_config, utils.copy

    def save_config(cfg: Any, filename: str, output_dir: Any) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(str(output_dir / filename), "w", encoding="utf-8") as file:
            file.write(config_yaml_text(cfg))

    utils._save_config = save_config
    utils.copy = types.SimpleNamespace(deepcopy=copy_config)  # run_job's only use of copy
    try:
        yield
    finally:
        utils._save_config, utils.copy = original


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


def machine_profile(name: str) -> MachineProfile:
    """The machine profile ``conf/machine/<name>.yaml`` alone (no interpolations to resolve
    beyond its own), for tools that need a second machine, e.g. a rehearsal's local one."""
    from omegaconf import OmegaConf

    where, file = machine_files()[name]
    raw = OmegaConf.to_container(OmegaConf.create(file.read_text()), resolve=True)
    try:
        return checked_profile(raw, lambda: raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


DEFAULT_MACHINE = "local"  # conf/config.yaml's defaults


def machine_names(scheduler: str = "") -> list[str]:
    """The machine profiles (``conf/machine/*.yaml``), for the lists in help texts and
    messages; only those of ``scheduler`` if given. The default first, then from the smallest
    memory per GPU up (this computer and the local cluster, then the sites), then by name."""
    import yaml

    load = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser where built
    raw = {name: yaml.load(file.read_text(), load) for name, (_, file) in machine_files().items()}
    names = [n for n, p in raw.items() if not scheduler or p.get("scheduler") == scheduler]
    gpu_memory = {n: raw[n].get("hardware", {}).get("mem_per_gpu_gb", 0) for n in names}
    return sorted(names, key=lambda n: (n != DEFAULT_MACHINE, gpu_memory[n], n))


def machine_files() -> dict[str, tuple[str, Any]]:
    """Each machine profile's name -> (the file as messages name it, its readable file): the
    package's ``conf/machine/``, then the site directory's, whose profile of a name wins."""
    packaged = resources.files(CONFIG_MODULE).joinpath("machine")
    named = CONFIG_MODULE.replace(".", "/") + "/machine/"
    files = {f.name.removesuffix(".yaml"): (named + f.name, f) for f in packaged.iterdir()
             if f.name.endswith(".yaml")}  # fmt: skip
    site = site_dir()
    for f in sorted(site.joinpath("machine").glob("*.yaml")) if site else ():
        files[f.stem] = (str(f), f)
    return files


def machine_choices() -> str:
    """``local (default), slurm_local, ...``: the machines a ``machine=NAME`` may name."""
    return ", ".join(f"{n} (default)" if n == DEFAULT_MACHINE else n for n in machine_names())


def load(overrides: list[str]) -> LaunchConfig:
    """Compose and convert: the one call tools need."""
    return to_launch_config(compose(overrides))


def to_launch_config(cfg: Any) -> LaunchConfig:
    from omegaconf import OmegaConf

    site_dir()  # the launcher's Hydra skips a site directory that is not one: said here
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:
        raise ConfigError(_first_line(exc)) from exc
    raw.pop("hydra", None)
    raw.pop("study", None)  # a study config's own values (conf/study/), for interpolation
    cfg = build(LaunchConfig, raw, "")
    if cfg.allocation not in ALLOCATIONS:
        raise ConfigError(f"allocation={cfg.allocation!r}: valid: {', '.join(ALLOCATIONS)}")
    if cfg.code_snapshot and not scheduler.of(cfg.machine).queued:
        raise ConfigError(
            f"code_snapshot=true: machine={cfg.machine.name} runs the installed package;"
            " valid there: false (a snapshot is for Slurm machines)"
        )
    return dataclasses.replace(cfg, model=model_of_source(cfg.model, cfg.generate))


def model_of_source(model: ModelSpec, generate: GenerateConfig) -> ModelSpec:
    """The model a job runs: a generation job's checkpoint's own, a Hugging Face
    directory's shape (``model=hf``) or the preset checked against it, else the preset."""
    from axonn_launch.common.hf import HFConfigError, resolve_hf_model

    if generate.checkpoint:
        try:
            meta = read_step_meta(resolve_checkpoint(generate.checkpoint))
        except CheckpointMissing as exc:
            raise ConfigError(f"generate.{exc}") from exc
        return ModelSpec(**meta["model"])
    try:
        return resolve_hf_model(model)
    except HFConfigError as exc:
        raise ConfigError(str(exc)) from exc


def build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from plain data, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}={raw!r}: expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            hint = did_you_mean(str(key), names, prefix=f"{path}." if path else "")
            raise ConfigError(f"{where}: unknown key;{hint} valid keys here: {', '.join(names)}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            where = f"{path}.{f.name}" if path else f.name
            values[f.name] = convert(hints[f.name], raw[f.name], where)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


# what turns off a section that has an ``enabled`` key, given as its whole value
SWITCHED_OFF = ("off", False)

# Keys whose ``auto`` is None in the dataclass (the launcher resolves it), with what is valid
AUTO_KEYS = {
    "machine.slurm.time_min": "minutes >= 1, or auto (the longest the profile's"
    " slurm.time_bins allow for the job's nodes)",
    "train.checkpoint_every": "a number of steps >= 0 (0: only at the end and on a requeue"
    " signal) or auto (Young/Daly's interval, cost/expected_goodput.py)",
}


def convert(kind: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if path in AUTO_KEYS:
            return convert_auto(value, path)
        (inner,) = [a for a in args if a is not type(None)]
        return convert(inner, value, path)
    if dataclasses.is_dataclass(kind):
        if value in SWITCHED_OFF and "enabled" in {f.name for f in dataclasses.fields(kind)}:
            return kind(enabled=False)  # e.g. train.watchdog=off
        return build(kind, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r}: expected a list")
        return [convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r}: expected a mapping")
        return {str(k): convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return convert_scalar(kind, value, path)


def convert_auto(value: Any, path: str) -> int | None:
    """An integer, or ``auto`` (None: the launcher resolves it), for a key of ``AUTO_KEYS``."""
    if value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{path}={value!r}: expected {AUTO_KEYS[path]}")


def convert_scalar(kind: type, value: Any, path: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={value!r}: expected a number")
    if kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}={value!r}: expected a string")
    raise ConfigError(f"{path}: unsupported type {kind!r}")


def composition_error(overrides: list[str], exc: BaseException) -> str:
    """One line for a failed composition: the override that does not parse, else why."""
    return _bad_override(overrides) or explain_compose_error(exc)


def explain_compose_error(exc: BaseException) -> str:
    """Turn Hydra's multi-line composition errors into one line."""
    text = _chain_text(exc)
    ambiguous = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if ambiguous:
        return (
            f"{ambiguous.group(1)}: a list of values runs a sweep; add -m (multirun) to run"
            " one job per value, or quote a list as a value: 'KEY=[a,b]'"
        )
    override = re.search(r"Could not override '([^']+)'", text)
    if override and "not in struct" in text:
        key = override.group(1)
        nearest = nearest_key(key)
        if nearest:
            return f"{key}: unknown key; did you mean {nearest}? (`--cfg job` lists all keys)"
        return (
            f"{key}: unknown key (check the spelling, or add a new key to a"
            " mapping with +KEY=VALUE; `--cfg job` lists all keys)"
        )
    if override:
        return f"{override.group(1)}: {_last_meaningful_line(text)}"
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        valid = ", ".join(options) if options else "see conf/" + group
        line = f"{group}={option!r}: no such {group};{did_you_mean(option, options)} valid: {valid}"
        return line + (HOW_TO_ADD_MACHINE.format(name=option) if group == "machine" else "")
    return _first_line(exc)


# the end of the line for an unknown ``machine=NAME``: where a new profile goes
HOW_TO_ADD_MACHINE = (
    "; to add one, write DIR/machine/{name}.yaml (start from a copy of one in"
    " axonn_launch/conf/machine/ or docs/examples/site/) and set AXONN_SITE_DIR=DIR"
    " (or pass --config-dir DIR to the launcher; docs/site.md)"
)


def did_you_mean(word: str, options: list[str], prefix: str = "") -> str:
    """`` did you mean PREFIXOPTION?`` for the option nearest to a misspelled ``word``,
    else ``""``: a typo is answered with its fix, not only with the list to search."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" did you mean {prefix}{close[0]}?" if close else ""


def nearest_key(key: str) -> str | None:
    """The valid dotted key nearest to ``key`` (``train.steps`` for ``train.step``,
    ``grid.x`` for ``gird.x``), found in the typed config; None if none is close or
    the misspelled part is inside a free-form mapping."""
    kind: Any = LaunchConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(kind):
            return None
        hints = typing.get_type_hints(kind)
        if part not in hints:
            close = difflib.get_close_matches(part, list(hints), n=1, cutoff=0.6)
            return ".".join([*parts[:i], close[0], *parts[i + 1 :]]) if close else None
        kind = _dataclass_of(hints[part])
    return None


def _dataclass_of(kind: Any) -> Any:
    """``X`` for ``X | None``; any other type as it is."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def _bad_override(overrides: list[str]) -> str | None:
    """The first override that does not parse, explained; None if all parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        try:
            parser.parse_override(text)
        except Exception as exc:
            return f"{text!r}: not a valid KEY=VALUE override ({_first_line(exc)})"
    return None


def _chain_text(exc: BaseException | None) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _last_meaningful_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("full_key", "object_type", "To append"))]
    return lines[-1] if lines else text


# Hydra's own flags that take a value (``-cd DIR`` or ``--config-dir=DIR``)
VALUE_FLAGS = {
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--experimental-rerun",
}


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """Hydra's command line as (overrides, flags with values, bare flags)."""
    overrides, valued, bare = [], {}, set()
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and name in VALUE_FLAGS:
            valued[name] = value if eq else next(args, "")
        elif arg.startswith("-"):
            bare.add(name)
        else:
            overrides.append(arg)
    return overrides, valued, bare
