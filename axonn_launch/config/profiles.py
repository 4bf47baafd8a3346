"""Machine profiles: which there are (the package's ``conf/machine/`` and the site's), one
read alone, and the schema check of a composed tree's profile, named by its file
(``common/machine.py`` says what each kind of machine needs)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from axonn_launch.common.machine import MachineProfile, kind_problem, required_problem
from axonn_launch.config.schema import ConfigError, build, first_line
from axonn_launch.config.site import CONFIG_MODULE, site_dir


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
        raise ConfigError(f"{where}: {first_line(exc)}") from None


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
