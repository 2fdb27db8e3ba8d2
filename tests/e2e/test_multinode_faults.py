"""Faults of a server over two nodes, each a real sshd host on its own loopback address with its own
simulated GPUs: a node that never joins node 0 fails the launch with the address named, one that
fails while loading fails it with its own log, nothing is left on either node; a node that drops
off the network for longer than the hang bound gets the whole server relaunched once it answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tasks.server import LaunchFailed, ServerConfig, launch
from tests.support.common import free_port, pid_alive
from tests.support.hosts import (
    recorded_servers,
    run_env,
    sim_clean,
    sshd_hosts,
    start_run,
    two_node_partition,
    wait_rows,
)
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import FAST_EMU, assert_exactly_once
from tests.support.sshd import SshHost, cut_off, hosts_env, restart_sshd

pytestmark = pytest.mark.slow


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[list[SshHost]]:
    # not test_multinode.py's hosts: the files run side by side, each on its own Prefect server
    yield from sshd_hosts(tmp_path, ["127.0.0.4", "127.0.0.5"])


def _launch_cfg(hosts: list[SshHost], fault: str, monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The launcher's config of a tp-2 server over both hosts, with ``fault`` on one node."""
    for key, value in hosts_env(hosts).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)  # each host's come from its sshd
    head = hosts[0].address
    return ServerConfig(model_path=f"{REPO_ROOT}/data/models/demo", backend="emulator", tp_size=2, gpus=(0,),
                        host=head, port=free_port(head), peer_nodes=(hosts[1].url(),),
                        dist_init_addr=f"{head}:{free_port(head)}",
                        extra_args=(*FAST_EMU, "--emu-node-fault", fault))


def _ours(cfg: ServerConfig) -> list[psutil.Process]:
    """This launch's processes on any node (the hosts share this machine): their command line
    names its --dist-init-addr."""
    assert cfg.dist_init_addr is not None
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if cfg.dist_init_addr in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def test_a_node_that_never_joins_fails_the_launch_naming_the_address(
        hosts: list[SshHost], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _launch_cfg(hosts, "1:never-join", monkeypatch)
    with pytest.raises(LaunchFailed) as info:
        launch(cfg, hosts[0].url(), None, str(tmp_path / "logs"), deadline_s=8)
    failure = info.value.failure
    assert failure.kind == "timeout", failure
    # node 0 waits for node 1 where SGLang does: its last line
    assert failure.explanation.startswith("not ready within 8 s (last phase: parallel_init); "), failure
    assert (f"the process group was killed on every node: check the log for a hang, or raise the launch deadline "
            f"for a large model; over 2 nodes every node must join node 0 at --dist-init-addr {cfg.dist_init_addr} "
            "(reachable from each node, the same command): check each node's log") in failure.explanation, failure
    assert re.search(r"TP0\] Init parallel begin\.\n[^\n]*SIGTERM received", info.value.log_tail), info.value.log_tail
    assert info.value.retryable  # a timeout may be transient: the stage retries it
    assert not _ours(cfg) and all(sim_clean(h) for h in hosts)


def test_a_node_that_fails_while_loading_fails_the_launch_with_its_own_log(
        hosts: list[SshHost], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _launch_cfg(hosts, "1:crash-after=0", monkeypatch)
    with pytest.raises(LaunchFailed) as info:
        launch(cfg, hosts[0].url(), None, str(tmp_path / "logs"), deadline_s=120)
    failure = info.value.failure
    assert failure.explanation.startswith("node 1 (127.0.0.5) of the server ended: "), failure
    assert "emulated scheduler failure (--emu-node-fault 1:crash-after=0)" in info.value.log_tail, info.value.log_tail
    # node 0 lived (it waits in its next collective): the launch ended it too, and cleaned nothing else
    deadline = time.monotonic() + 30
    while _ours(cfg) or not all(sim_clean(h) for h in hosts):
        assert time.monotonic() < deadline, _ours(cfg)
        time.sleep(0.2)


def test_node_1_lost_for_longer_than_the_hang_bound_relaunches_the_server_once_it_answers(
        prefect_server: PrefectServer, hosts: list[SshHost], tmp_path: Path, reap_pids: list[int]) -> None:
    # Node 1 drops off (its rank dies and its sshd with it): node 0 hangs in its next collective,
    # the rank cannot be asked about (an unreachable node reads as alive), and the hang watchdog
    # ends node 0 after 5 s of failed probes. The lifecycle waits for node 1 (run.host_wait_s 30 s)
    # and relaunches the whole server once it answers.
    part, ids = two_node_partition(tmp_path, hosts, 240, host_wait_s=30)
    proc = start_run(part, tmp_path, run_env(prefect_server, tmp_path, hosts), reap_pids)
    wait_rows(proc, tmp_path, 30)
    head, node1 = recorded_servers(tmp_path)
    reap_pids.extend([head["pid"], node1["pid"]])
    victim = hosts[1]
    # the network goes first: every SSH session to node 1 dies with its sshd (a `ps` of the rank
    # watch in flight included, so nothing sees the rank's death below until node 1 answers again)
    cut_off(victim)
    os.killpg(node1["pgid"], signal.SIGKILL)
    # node 1 answers again once the hang watchdog has ended node 0 (and not before: then the rank
    # watch would see the rank gone first)
    deadline = time.monotonic() + 120
    while "alive but not answering /health_generate for 5 s" not in (tmp_path / "run.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-4000:]
        time.sleep(0.1)
    victim.proc = restart_sshd(victim.server)
    assert proc.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()[-4000:]
    text = (tmp_path / "run.log").read_text()

    assert_exactly_once(tmp_path / "out", {"ds": ids})
    name = "127.0.0.4+127.0.0.5[gpu 0]"
    assert f"server {name} dropped: hung (/health_generate failed for 5 s while it ran; killed)" in text, text[-4000:]
    assert (f"server {name} lifecycle: pending -> starting -> serving -> dropped -> relaunching -> serving -> "
            "stopped") in text, text[-4000:]
    for h in hosts:
        assert re.search(rf"hygiene relaunch-1 on {re.escape(h.address)}: GPU hygiene on {re.escape(h.url())}: "
                         r"CLEAN", text), text[-4000:]
    servers = recorded_servers(tmp_path)
    assert [s["target"] for s in servers] == [h.url() for h in hosts] * 2
    assert not any(pid_alive(s["pid"]) for s in servers)
    assert all(sim_clean(h) for h in hosts)
