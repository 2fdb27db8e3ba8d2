"""One server over two nodes (SGLang's --nnodes 2): two hosts, each a real sshd on its own loopback
address (127.0.0.2, .3) with its own simulated GPUs, reached over ssh:// as the scale-out tests do.
The emulator's ranks join node 0 at --dist-init-addr as SGLang's do; node 0 alone serves HTTP.
A node that never joins, one that fails while loading and one that drops off the network are in
test_multinode_faults.py.

What a person who has launched a two-node server by hand expects: every row once; a rank killed on
node 1 takes the whole server down (node 0 would hang in its next collective) and the server is
relaunched within its budget, both nodes cleaned in between; a killed `datagen run` leaves no rank
on any node; a stale rank on node 1 is found and ended by the hygiene before the launch."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from emulator.simgpu import SimGpus
from tasks.server._leash import LEASH_GRACE_S
from tests.support.common import free_port, pid_alive
from tests.support.hosts import (
    recorded_servers,
    run_env,
    served_rows,
    sim_clean,
    sshd_hosts,
    start_run,
    two_node_partition,
    wait_rows,
)
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import FAST_EMU, assert_exactly_once, records
from tests.support.sshd import SshHost

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
ADDRESSES = ["127.0.0.2", "127.0.0.3"]


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[list[SshHost]]:
    yield from sshd_hosts(tmp_path, ADDRESSES)


@pytest.fixture
def other_hosts(tmp_path: Path) -> Iterator[list[SshHost]]:
    """Two hosts no other test of this file uses: a killed run's ``gpu:<host>`` slots outlive it
    until their lease expires (60 s), which the next test on the same hosts would wait out."""
    yield from sshd_hosts(tmp_path, ["127.0.0.7", "127.0.0.8"])


def _hygiene(text: str, phase: str, address: str) -> str:
    """The hygiene report logged for ``phase`` on the host at ``address`` (its first line and the
    indented lines under it)."""
    head = f"hygiene {phase} on {address}: "
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if head in line)
    block = [lines[start].split(head, 1)[1]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return "\n".join(block)


def _launch_artifacts(prefect_server: PrefectServer, run_id: str) -> list[dict]:
    body = {"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"like_": "server-launch"}}}
    return httpx.post(f"{prefect_server.api_url}/artifacts/filter", json=body, timeout=30).raise_for_status().json()


def test_a_server_over_two_nodes_cleans_a_stale_rank_on_node_1_then_generates_every_row_once(
        prefect_server: PrefectServer, hosts: list[SshHost], tmp_path: Path, reap_pids: list[int]) -> None:
    # A rank of an earlier server, left on node 1 after its node 0 went away: it holds GPU 0 there.
    victim = hosts[1]
    with socket.create_server(("127.0.0.2", 0)) as listener:
        port = listener.getsockname()[1]
        env = {**os.environ, "DATAGEN_SIM_GPUS": str(victim.sim_gpus)}
        with open(tmp_path / "stale.log", "wb") as log:
            stale = subprocess.Popen([sys.executable, "-m", "emulator", "--model-path", f"{REPO_ROOT}/data/models/demo",
                                      "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                                      f"127.0.0.2:{port}", "--host", "127.0.0.3", "--port", str(free_port("127.0.0.3")),
                                      *FAST_EMU], env=env, cwd=REPO_ROOT, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        reap_pids.append(stale.pid)
        conn, _ = listener.accept()
        while "schedulers ready" not in (tmp_path / "stale.log").read_text():
            assert stale.poll() is None, (tmp_path / "stale.log").read_text()
            time.sleep(0.05)
        conn.close()  # its node 0 is gone; it waits on, holding its memory
    ((holder,),) = [g["processes"] for g in SimGpus(victim.sim_gpus).snapshot()["gpus"] if g["index"] == 0]
    assert holder["mib"] > 0 and sim_clean(hosts[0])

    part, ids = two_node_partition(tmp_path, hosts, 120)
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(tmp_path / "out")],
                          env=run_env(prefect_server, tmp_path, hosts), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    text = proc.stdout + proc.stderr
    (tmp_path / "run.log").write_text(text)
    assert proc.returncode == 0, text[-4000:]
    assert_exactly_once(tmp_path / "out", {"ds": ids})
    assert sorted(served_rows(tmp_path)) == sorted(ids)
    name = "127.0.0.2+127.0.0.3[gpu 0]"
    assert f"servers (final): {name} 120 rows " in text, text[-3000:]
    assert f"server {name} lifecycle: pending -> starting -> serving -> stopped" in text, text[-3000:]
    node0, node1_block = (_hygiene(text, "before-launch", h.address) for h in hosts)
    assert re.search(rf"^  kill  pid {holder['pid']} \(\S+\) GPU 0 {holder['mib']} MiB .*ended by SIG(TERM|KILL)$",
                     node1_block, re.M), node1_block
    assert node0.startswith(f"GPU hygiene on {hosts[0].url()}: CLEAN") and "  kill " not in node0, node0
    deadline = time.monotonic() + 30
    while stale.poll() is None:  # its scheduler ended, its main process follows
        assert time.monotonic() < deadline
        time.sleep(0.1)
    servers = recorded_servers(tmp_path)
    assert [s["target"] for s in servers] == [h.url() for h in hosts]
    assert [s["state"] for s in servers] == ["stopped", "stopped"]
    assert not any(pid_alive(s["pid"]) for s in servers)
    assert all(sim_clean(h) for h in hosts)
    # the launch artifact shows both nodes, each with its pid and log
    (run_id,) = records(tmp_path)
    (art,) = _launch_artifacts(prefect_server, run_id)
    head, node1 = servers
    addr = re.search(r"--dist-init-addr `127\.0\.0\.2:(\d+)`", art["data"])
    assert addr and "- nodes: **2**" in art["data"], art["data"]
    assert f"  - node 0: `127.0.0.2` pid {head['pid']} (serves HTTP), log `" in art["data"], art["data"]
    assert f"  - node 1: `127.0.0.3` pid {node1['pid']}, log `{node1['log']}`" in art["data"], art["data"]
    # node 1 ran the same command with its own rank, and joined node 0 there
    log1 = Path(node1["log"]).read_text()
    assert f"nnodes=2, node_rank=1, dist_init_addr='127.0.0.2:{addr[1]}'" in log1, log1[:2000]
    assert f"[node link] joined node 0 at 127.0.0.2:{addr[1]}" in log1, log1[-2000:]


def test_a_rank_killed_on_node_1_relaunches_the_whole_server(
        prefect_server: PrefectServer, hosts: list[SshHost], tmp_path: Path, reap_pids: list[int]) -> None:
    part, ids = two_node_partition(tmp_path, hosts, 240)
    proc = start_run(part, tmp_path, run_env(prefect_server, tmp_path, hosts), reap_pids)
    wait_rows(proc, tmp_path, 30)
    head, node1 = recorded_servers(tmp_path)
    reap_pids.extend([head["pid"], node1["pid"]])
    assert node1["target"] == hosts[1].url()
    os.killpg(node1["pgid"], signal.SIGKILL)  # the rank on node 1, and its schedulers
    assert proc.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()[-4000:]
    text = (tmp_path / "run.log").read_text()

    assert_exactly_once(tmp_path / "out", {"ds": ids})
    done = Counter(served_rows(tmp_path))
    assert sorted(done) == sorted(ids) and set(done.values()) == {1}  # no finished row generated twice
    name = "127.0.0.2+127.0.0.3[gpu 0]"
    assert (f"node 1 (127.0.0.3, pid {node1['pid']}) has ended: node 0 would hang in its next collective; "
            "ending the server on every node") in text, text[-4000:]
    assert f"server {name} dropped: node 1 (127.0.0.3) died (unknown); the server was ended on every node" in text, \
        text[-4000:]
    assert (f"server {name} lifecycle: pending -> starting -> serving -> dropped -> relaunching -> serving -> "
            "stopped") in text, text[-4000:]
    # both nodes' GPUs verified clean between the two launches
    for h in hosts:
        assert re.search(rf"hygiene relaunch-1 on {re.escape(h.address)}: GPU hygiene on {re.escape(h.url())}: "
                         r"CLEAN", text), text[-4000:]
    servers = recorded_servers(tmp_path)
    assert [s["target"] for s in servers] == [h.url() for h in hosts] * 2  # two launches of both nodes
    assert not any(pid_alive(s["pid"]) for s in servers)
    assert all(sim_clean(h) for h in hosts)


def test_a_killed_datagen_run_leaves_no_rank_on_any_node(
        prefect_server: PrefectServer, other_hosts: list[SshHost], tmp_path: Path, reap_pids: list[int]) -> None:
    hosts = other_hosts
    part, _ = two_node_partition(tmp_path, hosts, 240)
    proc = start_run(part, tmp_path, run_env(prefect_server, tmp_path, hosts), reap_pids)
    wait_rows(proc, tmp_path, 20)
    servers = recorded_servers(tmp_path)
    reap_pids.extend(s["pid"] for s in servers)
    assert [s["target"] for s in servers] == [h.url() for h in hosts]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # each rank's guardian ends it: within its grace (nothing adopts a server over several nodes),
    # and a few seconds for the guardian's own look
    deadline = time.monotonic() + LEASH_GRACE_S + 15
    while any(pid_alive(s["pid"]) for s in servers):
        assert time.monotonic() < deadline, [s for s in servers if pid_alive(s["pid"])]
        time.sleep(0.2)
    while not all(sim_clean(h) for h in hosts):
        assert time.monotonic() < deadline, [SimGpus(h.sim_gpus).snapshot() for h in hosts]
        time.sleep(0.2)
