"""The Prefect server's database URL as `datagen up` takes it: accepted forms, the masked form in every
message, the environment of the processes that must not carry it, and the prefect file's pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen._database import (
    DatabaseUnreachable,
    check_database,
    database_url,
    mask_url,
    scrub,
    without_database_settings,
)
from datagen.cmd_up import check_pool_name, deployments_of
from tasks.config import ConfigError
from tests.support.common import free_port
from tests.support.paths import REPO_ROOT


@pytest.mark.parametrize(("given", "masked"), [
    ("postgresql+asyncpg://u:p%40ss@db:5432/prefect", "postgresql+asyncpg://u:***@db:5432/prefect"),
    ("postgresql+asyncpg://u@db/prefect", "postgresql+asyncpg://u@db/prefect"),
    ("postgresql+asyncpg://u@db/prefect?password=pw&ssl=require", "postgresql+asyncpg://u@db/prefect?password=***&ssl=require"),
    ("sqlite+aiosqlite:///x.db?cache=shared&uri=true", "sqlite+aiosqlite:///x.db?cache=shared&uri=true"),
])
def test_mask_url_hides_the_password_only(given: str, masked: str) -> None:
    assert mask_url(given) == masked


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+asyncpg"])
def test_postgres_urls_get_prefects_async_driver(scheme: str) -> None:
    assert database_url(f" {scheme}://u:pw@db:6432/prefect ") == "postgresql+asyncpg://u:pw@db:6432/prefect"


def test_sqlite_urls_pass_unchanged() -> None:
    assert database_url("sqlite+aiosqlite:////srv/prefect.db") == "sqlite+aiosqlite:////srv/prefect.db"


@pytest.mark.parametrize(("url", "why"), [
    ("mysql://u:topsecret@db/prefect", "scheme 'mysql' is not PostgreSQL"),
    ("postgresql://u:topsecret@/prefect", "names no host"),
    ("postgresql://u:topsecret@db:5432", "names no database"),
    ("postgresql://u:topsecret@db:port/prefect", "Port could not be cast"),
    ("db:5432/prefect", "is not PostgreSQL"),
])
def test_bad_urls_are_named_masked_with_the_form_to_give(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        database_url(url)
    assert why in str(err.value) and "topsecret" not in str(err.value)
    assert "postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DATABASE" in str(err.value)


def test_scrub_removes_every_spelling_of_the_password() -> None:
    url = "postgresql+asyncpg://u:p%40ss@db/prefect"
    assert scrub("auth p%40ss failed for p@ss", url) == "auth *** failed for ***"
    assert scrub("nothing to hide", None) == "nothing to hide"


def test_an_unreachable_database_is_a_usage_error_naming_it_masked() -> None:
    url = f"postgresql+asyncpg://u:topsecret@127.0.0.1:{free_port()}/prefect"
    with pytest.raises(DatabaseUnreachable) as err:
        check_database(url, timeout_s=5)
    msg = str(err.value)
    assert msg.startswith(f"server database {mask_url(url)}: cannot reach PostgreSQL at 127.0.0.1:")
    assert "topsecret" not in msg and "start it, or fix the URL" in msg
    assert check_database("sqlite+aiosqlite:///x.db") is None


def test_processes_other_than_the_server_get_no_database_setting() -> None:
    env = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": "x", "PREFECT_API_DATABASE_PASSWORD": "y",
           "PREFECT_SERVER_DATABASE_HOST": "z", "PREFECT_API_URL": "http://a/api", "PATH": "/bin"}
    assert without_database_settings(env) == {"PREFECT_API_URL": "http://a/api", "PATH": "/bin"}


def test_the_projects_prefect_file_puts_every_partition_on_the_gpu_pool() -> None:
    names, pools = deployments_of(REPO_ROOT / "prefect.yaml")
    assert names == ["all", "glaive_like", "opencode_like", "adhoc", "demo"]
    assert pools == ["gpu"]


def test_a_prefect_file_lists_its_pools_once_in_order(tmp_path: Path) -> None:
    f = tmp_path / "prefect.yaml"
    f.write_text("deployments:\n"
                 "  - {name: a, work_pool: {name: host-b}}\n  - {name: b, work_pool: {name: gpu}}\n"
                 "  - {name: c, work_pool: {name: host-b}}\n")
    assert deployments_of(f) == (["a", "b", "c"], ["host-b", "gpu"])
    f.write_text("deployments:\n  - {name: a}\n")
    with pytest.raises(ConfigError, match="deployment 'a' names no work_pool"):
        deployments_of(f)
    f.write_text("deployments: [\n")
    with pytest.raises(ConfigError, match="not YAML"):
        deployments_of(f)
    with pytest.raises(ConfigError, match="No such file"):
        deployments_of(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["gpu", "host-b", "pool_2.a"])
def test_pool_names_that_can_name_a_pid_file(name: str) -> None:
    assert check_pool_name(name) == name


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "with space"])
def test_other_pool_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="work pool name"):
        check_pool_name(name)
