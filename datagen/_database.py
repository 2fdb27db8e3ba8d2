"""The database of the Prefect server `datagen up` starts: the URL's accepted forms, the masked form
every message shows (never the password), a connection check before the server starts, and the
environment of everything else `up` starts, without the database settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from tasks.config import ConfigError
from tasks.errors import DatagenError

__all__ = [
    "DATABASE_URL_ENV", "DatabaseUnreachable", "check_database", "database_url", "mask_url", "scrub",
    "without_database_settings",
]

DATABASE_URL_ENV = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
# Prefect reads both spellings (the second is its older name); workers and flow runs need neither.
_DATABASE_ENV_PREFIXES = ("PREFECT_SERVER_DATABASE_", "PREFECT_API_DATABASE_")
_POSTGRES_SCHEMES = ("postgresql+asyncpg", "postgresql", "postgres")
_SQLITE_SCHEME = "sqlite+aiosqlite"
_FORM = "postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DATABASE"


class DatabaseUnreachable(DatagenError, ConnectionError):
    """The server database cannot be reached, or refused the user or the database name; the message
    names it (password masked) and what to change."""


def _password(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
    except ValueError:
        return None
    return parts.password or query.get("password")


def mask_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query item) shown as ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if _password(url) is None:
        return url  # unchanged: geturl() would also drop the empty host of sqlite+aiosqlite:///PATH
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = parts.query
    if "password" in dict(parse_qsl(query)):
        query = "&".join(f"{k}=***" if k == "password" else f"{k}={v}" for k, v in parse_qsl(query))
    return parts._replace(netloc=netloc, query=query).geturl()


def scrub(text: str, url: str | None) -> str:
    """``text`` with every spelling of ``url``'s password replaced: driver errors may quote it."""
    secret = _password(url) if url else None
    if secret:
        for spelling in {secret, unquote(secret)}:
            text = text.replace(spelling, "***")
    return text


def _split(url: str) -> SplitResult:
    parts = urlsplit(url)
    if parts.port == 0:  # .port itself raises ValueError for one that is not a number or out of range
        raise ValueError("port 0")
    return parts


def database_url(url: str) -> str:
    """The URL the Prefect server is given: ``postgresql://`` and ``postgres://`` become
    ``postgresql+asyncpg://`` (the only PostgreSQL driver Prefect runs on); ``sqlite+aiosqlite://``
    passes unchanged.

    Raises:
        ConfigError: another scheme, or a PostgreSQL URL without a host or a database name.
    """
    url = url.strip()
    try:
        parts = _split(url)
    except ValueError as exc:
        raise ConfigError(f"database URL {mask_url(url)}: {exc}; give {_FORM}") from None
    if parts.scheme == _SQLITE_SCHEME:
        return url
    if parts.scheme not in _POSTGRES_SCHEMES:
        raise ConfigError(f"database URL {mask_url(url)}: scheme {parts.scheme or '(none)'!r} is not PostgreSQL; "
                          f"give {_FORM} (or {_SQLITE_SCHEME}:///PATH for SQLite)")
    if not parts.hostname or not parts.path.strip("/"):
        raise ConfigError(f"database URL {mask_url(url)}: names no {'host' if not parts.hostname else 'database'}; "
                          f"give {_FORM}")
    return parts._replace(scheme="postgresql+asyncpg").geturl()


async def _connect(dsn: str, timeout_s: float) -> str:
    import asyncpg  # Prefect's own PostgreSQL driver; only `up --database-url` needs it

    conn = await asyncpg.connect(dsn, timeout=timeout_s)
    try:
        return str(await conn.fetchval("SHOW server_version", timeout=timeout_s))
    finally:
        await conn.close(timeout=timeout_s)


def check_database(url: str, timeout_s: float = 10.0) -> str | None:
    """Connect to the PostgreSQL database of ``url`` (a ``database_url`` result) as the server will,
    and return its server version; None for SQLite (nothing to reach).

    Raises:
        DatabaseUnreachable: no connection within ``timeout_s``, the user or password refused, or no
            such database. The message names the masked URL and what to do.
    """
    if not url.startswith("postgresql+asyncpg://"):
        return None
    import asyncpg

    parts = urlsplit(url)
    where = f"PostgreSQL at {parts.hostname}:{parts.port or 5432}"
    user, db = parts.username or "(default user)", parts.path.strip("/")
    fix = f"fix the URL (--database-url or ${DATABASE_URL_ENV})"
    try:
        return asyncio.run(_connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout_s))
    except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError) as exc:
        why = f"{where} refused user {user!r} ({exc}): {fix}, or grant the user access"
    except asyncpg.InvalidCatalogNameError:
        why = (f"{where} has no database {db!r}: create it (createdb -h {parts.hostname} -p {parts.port or 5432} "
               f"-U {user} {db}) or {fix}")
    except (OSError, TimeoutError) as exc:
        why = f"cannot reach {where} ({type(exc).__name__}: {exc or 'timed out'}): start it, or {fix}"
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        why = f"{where}: {type(exc).__name__}: {exc}: {fix}"
    raise DatabaseUnreachable(scrub(f"server database {mask_url(url)}: {why}", url))


def without_database_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less Prefect's server database settings: the worker, the deploy and every flow run
    talk to the API, never to the database, and must not carry its password."""
    return {k: v for k, v in env.items() if not k.startswith(_DATABASE_ENV_PREFIXES)}
