"""datagen._prefect_api.PrefectApi against a real loopback HTTP server: what it retries and what not."""
from __future__ import annotations

import pytest

from datagen import _prefect_api
from datagen._prefect_api import PrefectApi
from tests.support.inference import canned_server


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_prefect_api, "FIRST_DELAY_S", 0.01)


def test_a_locked_database_503_is_retried_until_the_write_goes_through() -> None:
    seen: list[bytes] = []
    with canned_server([503, 503, 200], b'{"ok": true}', seen) as url, PrefectApi(url + "/api/") as http:
        resp = http.post("/deployments/filter", json={"n": 1})
    assert resp.status_code == 200 and resp.json() == {"ok": True}
    assert seen == [b'{"n":1}'] * 3


def test_a_client_error_is_returned_at_once() -> None:
    seen: list[bytes] = []
    with canned_server([404, 200], b"{}", seen) as url, PrefectApi(url) as http:
        assert http.post("/automations/filter", json={}).status_code == 404
    assert len(seen) == 1


def test_a_server_that_stays_unavailable_gives_its_503_after_the_last_try() -> None:
    seen: list[bytes] = []
    with canned_server(503, b"{}", seen) as url, PrefectApi(url) as http:
        assert http.post("/x", json={}).status_code == 503
    assert len(seen) == _prefect_api.MAX_TRIES
