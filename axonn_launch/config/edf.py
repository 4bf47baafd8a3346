"""CSCS Container Engine environment definition files (EDF), read on the login node.

An Alps job runs every task inside the container its EDF names (``srun --environment=``);
only what the EDF mounts is visible there, so the launcher checks the job directory and
the interpreter against its mounts. Never imports torch.

The facts used, with their CSCS sources: ``docs/launch.md`` ("config/edf.py").
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class EDFError(ValueError):
    """An EDF that cannot be used: missing, not TOML, or without an image."""


@dataclass(frozen=True)
class Mount:
    source: str
    destination: str

    @classmethod
    def parse(cls, text: str) -> Mount:
        parts = text.split(":")
        source = parts[0]
        return cls(source, parts[1] if len(parts) > 1 and parts[1] else source)

    def shows_at_same_path(self, path: str) -> bool:
        """``path`` (absolute) is visible inside the container at the same path."""
        source, destination = _norm(self.source), _norm(self.destination)
        return source == destination and _is_under(_norm(path), source)


@dataclass(frozen=True)
class EDF:
    path: Path
    image: str
    mounts: list[Mount] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def covers(self, path: str) -> bool:
        """Whether the tasks see ``path`` where the login node sees it."""
        return any(mount.shows_at_same_path(path) for mount in self.mounts)

    def mount_list(self) -> str:
        return ", ".join(m.source if m.source == m.destination else f"{m.source}:{m.destination}"
                         for m in self.mounts) or "none"  # fmt: skip


def locate(environment: str, environ: dict[str, str] | None = None) -> Path:
    """The file ``srun --environment=<environment>`` would read; raises EDFError."""
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())
    key = "machine.container.environment"
    if "/" in environment or environment.endswith(".toml"):
        path = Path(environment) if environment.startswith("/") else home / environment
        if not path.is_file():
            raise EDFError(f"{key}={environment!r}: no EDF file at {path}")
        return path
    search = [Path(d) for d in env.get("EDF_PATH", "").split(":") if d] + [home / ".edf"]
    for directory in search:
        candidate = directory / f"{environment}.toml"
        if candidate.is_file():
            return candidate
    where = ", ".join(str(d) for d in search)
    raise EDFError(
        f"{key}={environment!r}: no {environment}.toml in the EDF search path ({where});"
        f" copy machines/alps/axonn.toml to ~/.edf/, or name the file by its path"
    )


# the project's own EDFs, ``machines/<machine>/<name>.toml`` (in a checkout, not in a wheel)
MACHINES_DIR = Path(__file__).resolve().parents[2] / "machines"


def project_copy(environment: str, machine: str) -> Path | None:
    """The project's own EDF named ``environment`` for ``machine`` (the file users copy
    to ``~/.edf``), or None when there is none or the environment names a path."""
    if "/" in environment or environment.endswith(".toml"):
        return None
    path = MACHINES_DIR / machine / f"{environment}.toml"
    return path if path.is_file() else None


def read(path: Path, environ: dict[str, str] | None = None) -> EDF:
    """Parse and check an EDF: TOML, an image, mounts as a list; ``${VAR}`` expanded."""
    env = os.environ if environ is None else environ
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise EDFError(f"EDF {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise EDFError(f"EDF {path}: not valid TOML ({exc})") from None
    image = data.get("image")
    if not isinstance(image, str) or not image.strip():
        raise EDFError(f'EDF {path}: no image; set image = "<registry/image:tag>"')
    mounts = data.get("mounts", [])
    if not isinstance(mounts, list) or not all(isinstance(m, str) for m in mounts):
        raise EDFError(f"EDF {path}: mounts={mounts!r}: expected a list of strings")
    variables = data.get("env", {})
    if not isinstance(variables, dict):
        raise EDFError(f'EDF {path}: [env] must be a table of NAME = "value"')
    return EDF(
        path=path,
        image=image,
        mounts=[Mount.parse(_expand(m, env)) for m in mounts],
        env={str(k): _expand(str(v), env) for k, v in variables.items()},
    )


def load(environment: str, environ: dict[str, str] | None = None) -> EDF:
    return read(locate(environment, environ), environ)


def _expand(text: str, env) -> str:
    """``${NAME}`` from ``env``; an unknown name stays as written."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env.get(m[1], m[0]), text)


def _norm(path: str) -> str:
    return str(PurePosixPath(os.path.normpath(path)))


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
