"""The command line's overrides: Hydra's flags split from them, their parse, and a failed
composition said in one line (the override that does not parse, an unknown key and its
nearest valid one, an unknown group option and how to add a machine)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from typing import Any

from axonn_launch.config.schema import ConfigError, LaunchConfig, did_you_mean, first_line


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of ``overrides`` (a ConfigError naming the one that does not parse)."""
    try:
        return [parsed_override(text) for text in overrides]
    except Exception as exc:
        raise ConfigError(composition_error(overrides, exc)) from exc


@functools.lru_cache(maxsize=4096)
def parsed_override(text: str) -> Any:
    """Hydra's parse of one override, once per text: a sweep's points share most of theirs,
    and each point's are parsed by the argument check, Hydra's batch check and its
    composition (an ``Override`` is not changed after its parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(text)


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
    return first_line(exc)


# the end of the line for an unknown ``machine=NAME``: where a new profile goes
HOW_TO_ADD_MACHINE = (
    "; to add one, write DIR/machine/{name}.yaml (start from a copy of one in"
    " axonn_launch/conf/machine/ or docs/examples/site/) and set AXONN_SITE_DIR=DIR"
    " (or pass --config-dir DIR to the launcher; docs/site.md)"
)


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
            return f"{text!r}: not a valid KEY=VALUE override ({first_line(exc)})"
    return None


def _chain_text(exc: BaseException | None) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


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
