"""A site's own directory (``AXONN_SITE_DIR``, docs/site.md): its profiles and accounts
outside the package, put before the package's ``conf/`` on Hydra's search path."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from axonn_launch.config.schema import ConfigError

CONFIG_MODULE = "axonn_launch.conf"

SITE_ENV = "AXONN_SITE_DIR"  # a directory of machine/<name>.yaml and local/default.yaml


def site_dir() -> Path | None:
    """The site directory ``AXONN_SITE_DIR`` names, absolute; None when unset. A value that is
    not a directory is a ConfigError naming it."""
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
    before = os.environ.get(SITE_ENV)
    _set_env(SITE_ENV, path)
    try:
        yield
    finally:
        _set_env(SITE_ENV, before)


def _set_env(name: str, value: str | None) -> None:

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
