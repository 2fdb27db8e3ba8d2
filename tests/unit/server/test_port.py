"""Who holds a port: the stdlib probe's listener scan and the launcher's reading of it."""

from __future__ import annotations

import os
import socket

import pytest

from tasks import gpus
from tasks.hygiene import port_listeners
from tasks.server._port import bind_refused, conflicting, describe_holders, held_by, listeners_on


@pytest.fixture
def listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


def test_probe_lists_the_listener_and_this_process_as_its_holder(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    answer = gpus.handle({"op": "listeners", "port": port})
    [item] = answer["listeners"]
    assert (item["address"], item["port"]) == ("127.0.0.1", port)
    [holder] = item["holders"]
    assert holder["pid"] == os.getpid() and holder["pgid"] == os.getpgid(0) and holder["sid"] == os.getsid(0)
    assert "pytest" in holder["cmdline"] or "python" in holder["cmdline"]
    assert port_listeners("local", port) == answer["listeners"]


def test_probe_reads_ipv6_listeners_and_ignores_connected_sockets(listening: socket.socket) -> None:
    with socket.socket(socket.AF_INET6) as s6:
        s6.bind(("::1", 0))
        s6.listen()
        [item] = gpus.port_listeners(s6.getsockname()[1])
        assert item["address"] == "::1"
    port = listening.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        assert len(gpus.port_listeners(port)) == 1  # the connection's sockets are not listeners


def test_a_free_port_has_no_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert gpus.port_listeners(port) == []
        assert listeners_on("local", "127.0.0.1", port) == []


def test_bad_listener_request_is_an_error_answer() -> None:
    assert "error" in gpus.handle({"op": "listeners"})


@pytest.mark.parametrize("address, host, conflicts", [
    ("127.0.0.1", "127.0.0.1", True),
    ("0.0.0.0", "127.0.0.1", True),
    ("::", "127.0.0.1", True),
    ("127.0.0.2", "127.0.0.1", False),
    ("127.0.0.2", "0.0.0.0", True),
    ("::1", "localhost", True),
    ("10.0.0.5", "gpu-box.internal", True),  # a name: any listener on the port counts
])
def test_which_listeners_stop_a_bind(address: str, host: str, conflicts: bool) -> None:
    assert bool(conflicting([{"address": address}], host)) is conflicts


def test_holders_are_named_and_ownership_follows_the_group() -> None:
    mine = {"address": "127.0.0.1", "user": "me",
            "holders": [{"pid": 41, "pgid": 40, "sid": 40, "cmdline": "python -m sglang.launch_server --port 1"}]}
    hidden = {"address": "0.0.0.0", "user": "postgres", "holders": []}
    assert describe_holders([mine, hidden]) == (
        "pid 41 (python -m sglang.launch_server --port 1), a process of user postgres that cannot be inspected")
    assert describe_holders(None) == ""
    assert held_by([mine], pgid=40) and held_by([mine], pgid=7, pids=[41])
    assert not held_by([mine, hidden], pgid=7)


def test_bind_refused_sees_a_listener_and_a_free_port(listening: socket.socket) -> None:
    assert bind_refused("127.0.0.1", listening.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert not bind_refused("127.0.0.1", free)
