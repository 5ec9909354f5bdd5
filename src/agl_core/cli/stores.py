"""Which store a reading command opens: ``--db FILE`` (a ``SqliteStore``) or ``--server URL`` (an ``HttpStore``).

A reading command never creates a store: a ``--db`` that does not exist is a
usage error naming ``--db``, not a new empty file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from agl_core.store.http import HttpStore
    from agl_core.store.sqlite import SqliteStore

_F = TypeVar("_F", bound=Callable[..., Any])


def store_options(command: _F) -> _F:
    """Add ``--db``, ``--server`` and ``--token`` to a command."""
    options = [
        click.option("--db", "db", default="agl.db", show_default=True, metavar="FILE",
                     help="an agl SQLite store (agl.SqliteStore)"),
        click.option("--server", "server", metavar="URL",
                     help="read from an agl server instead (agl.HttpStore), e.g. http://127.0.0.1:8000"),
        click.option("--token", "token", envvar="AGL_TOKEN", metavar="TOKEN",
                     help="the server's bearer token [env: AGL_TOKEN]"),
    ]
    return functools.reduce(lambda f, option: option(f), reversed(options), command)


def open_store(db: str, server: str | None, token: str | None) -> SqliteStore | HttpStore:
    """The store the options name; a missing ``--db`` file is a usage error, never created."""
    if server:
        from agl_core.store.http import HttpStore

        if not server.startswith(("http://", "https://")):
            raise click.BadParameter(f"must be an http:// or https:// URL, got {server!r}", param_hint="'--server'")
        return HttpStore(server, token, retry_s=2.0, timeout=30.0)
    if not os.path.exists(db):
        raise click.BadParameter(f"no such file: {db}", param_hint="'--db'")
    if os.path.isdir(db):
        raise click.BadParameter(f"is a directory, not an agl store: {db}", param_hint="'--db'")
    from agl_core.errors import AglError
    from agl_core.store.sqlite import SqliteStore

    try:
        return SqliteStore(db)
    except AglError as exc:  # not an agl store, or one written by a newer agl: the file is left as it was
        raise click.BadParameter(str(exc), param_hint="'--db'") from None


def where(db: str, server: str | None) -> str:
    """How error messages name the store: the server's URL or the file."""
    return server or db
