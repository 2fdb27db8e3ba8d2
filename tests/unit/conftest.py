"""Unit tests stay in-process: Prefect log records are not sent to an API, so a test that calls a
Prefect task's function or a flow hook never makes Prefect start a temporary server."""

from collections.abc import Iterator

import pytest
from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings


# Per module, not per test: entering temporary_settings rebuilds Prefect's settings (about 60 ms),
# which was half of `make unit`'s time when paid by each of its 800 tests.
@pytest.fixture(autouse=True, scope="module")
def _no_prefect_api_logging() -> Iterator[None]:
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        yield
