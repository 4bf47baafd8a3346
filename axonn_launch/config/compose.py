"""Hydra composes; this module turns the composed tree into typed dataclasses, once.

Everything below ``to_launch_config`` takes plain dataclasses. Errors are
``ConfigError`` with a one-line message naming the field, the value and what would
be valid.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from axonn_launch import scheduler
from axonn_launch.common.jobdir import CheckpointMissing, read_step_meta, resolve_checkpoint
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GenerateConfig
from axonn_launch.config.overrides import composition_error, split_argv
from axonn_launch.config.profiles import (
    DEFAULT_MACHINE,
    check_profile,
    machine_choices,
    machine_names,
    machine_profile,
)
from axonn_launch.config.schema import (
    ALLOCATIONS,
    AUTO_KEYS,
    ConfigError,
    GridRequest,
    LaunchConfig,
    RecoveryConfig,
    Site,
    SweepConfig,
    account_override,
    build,
    first_line,
)
from axonn_launch.config.site import (
    CONFIG_MODULE,
    SITE_ENV,
    register_site_path,
    site_dir,
    site_record,
    using_site,
)
from axonn_launch.config.yaml_text import config_yaml_text, copy_config, yaml_text

__all__ = [  # the names the launcher's modules import from here; each is defined where named
    "AUTO_KEYS", "CONFIG_MODULE", "DEFAULT_MACHINE", "SITE_ENV", "ConfigError", "GridRequest",
    "LaunchConfig", "RecoveryConfig", "Site", "SweepConfig", "account_override", "build",
    "check_profile", "compose", "composition_error", "config_yaml_text", "copy_config", "load",
    "machine_choices", "machine_names", "machine_profile", "site_record", "split_argv",
    "to_launch_config", "using_site", "yaml_text",
]  # fmt: skip

# Overrides that a point's name leaves out: already in the name, or not about the run.
UNNAMED_KEYS = (
    "machine", "model", "name", "dry_run", "wait", "nodes", "objective", "preflight", "study",
    "scale", "rehearse", "rehearse_rank", "recovery", "force", "resume", "show_config",
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


def load(overrides: list[str]) -> LaunchConfig:
    """Compose and convert: the one call tools need."""
    return to_launch_config(compose(overrides))


def to_launch_config(cfg: Any) -> LaunchConfig:
    from omegaconf import OmegaConf

    site_dir()  # the launcher's Hydra skips a site directory that is not one: said here
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:
        raise ConfigError(first_line(exc)) from exc
    raw.pop("hydra", None)
    raw.pop("study", None)  # a study config's own values (conf/study/), for interpolation
    cfg = build(LaunchConfig, rank_rehearsal(raw), "")
    if cfg.allocation not in ALLOCATIONS:
        raise ConfigError(f"allocation={cfg.allocation!r}: valid: {', '.join(ALLOCATIONS)}")
    if cfg.code_snapshot and not scheduler.of(cfg.machine).queued:
        raise ConfigError(
            f"code_snapshot=true: machine={cfg.machine.name} runs the installed package;"
            " valid there: false (a snapshot is for Slurm machines)"
        )
    return dataclasses.replace(cfg, model=model_of_source(cfg.model, cfg.generate))


def rank_rehearsal(raw: dict) -> dict:
    """``rehearse=rank``: a dry run, then one rank here (``rehearse_rank``, default 0;
    submit/rank_rehearsal.py); ``rehearse_rank`` alone is a ConfigError."""
    if raw.get("rehearse") == "rank":
        rank = raw.get("rehearse_rank")
        return {**raw, "rehearse": False, "dry_run": True, "rehearse_rank": rank or 0}
    if raw.get("rehearse_rank") is not None:
        raise ConfigError(
            f"rehearse_rank={raw['rehearse_rank']!r}: only with rehearse=rank; valid: unset"
        )
    return raw


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
