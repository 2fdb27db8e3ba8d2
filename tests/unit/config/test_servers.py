"""Several servers per partition: ``[server] targets`` entries with GPU groups, ports and per-target
flags expand into one server each; several running servers' URLs; bad entries fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import ConfigError, RunSettings, load_partition, project_root

ROOT = project_root()


def _load(tmp_path: Path, server: str, run: str = "") -> object:
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    f = tmp_path / "p.toml"
    f.write_text(f'[datasets]\nx = "in.jsonl"\n[model]\npath = "{ROOT}/data/models/demo"\n'
                 f'[server]\nbackend = "emulator"\n{server}\n[run]\n{run}\n[output]\nroot = "o"\n')
    return load_partition(f)


def test_entries_expand_into_one_server_per_gpu_group(tmp_path: Path) -> None:
    cfg = _load(tmp_path, 'tp_size = 2\ngpus = [4, 5]\ntargets = ["local", { target = "ssh://gpu1", '
                          'gpus = [[0, 1], [2, 3], [4, 5], [6, 7]] }, '
                          '{ target = "pct://root@pve/101", port = 31000, gpus = [[0, 1], [2, 3]], '
                          'flags = { python = "/opt/sglang/bin/python", max_running_requests = 64 } }]')
    slots = cfg.servers()  # type: ignore[attr-defined]
    assert [(s.target, s.gpus, s.port) for s in slots] == [
        ("local", None, 0), ("ssh://gpu1", (0, 1), 30000), ("ssh://gpu1", (2, 3), 30001),
        ("ssh://gpu1", (4, 5), 30002), ("ssh://gpu1", (6, 7), 30003),
        ("pct://root@pve/101", (0, 1), 31000), ("pct://root@pve/101", (2, 3), 31001)]
    assert [s.label() for s in slots[4:6]] == ["gpu1[gpu 6,7]", "pve/101[gpu 0,1]"]
    local = cfg.for_server(slots[0])  # type: ignore[attr-defined]
    assert local.server.launch.gpu_indexes() == [4, 5] and local.targets == ("local",)
    pct = cfg.for_server(slots[6])  # type: ignore[attr-defined]
    launch = pct.server.launch
    assert (launch.gpu_indexes(), launch.python, launch.max_running_requests) == ([2, 3], "/opt/sglang/bin/python", 64)
    assert pct.server.port == 31001 and pct.targets == ("pct://root@pve/101",)
    # every server generates alike: one fingerprint for the rows of the run
    assert len({cfg.for_server(s).server_fingerprint() for s in slots}) == 1  # type: ignore[attr-defined]
    assert cfg.targets == ("local", "ssh://gpu1", "pct://root@pve/101")  # type: ignore[attr-defined]


def test_a_plain_target_list_keeps_one_server_each(tmp_path: Path) -> None:
    cfg = _load(tmp_path, 'targets = ["local"]\nport = 31500')
    (slot,) = cfg.servers()  # type: ignore[attr-defined]
    assert (slot.target, slot.gpus, slot.port) == ("local", None, 31500)
    assert cfg.server.target_servers == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("server", "message"), [
    ('targets = [{ gpus = [0] }]', "server.targets[0].target: required"),
    ('targets = [{ target = "ssh://h", gpu = [0] }]', "server.targets[0].gpu: unknown key"),
    ('targets = [{ target = "ssh://h", gpus = [[0, 1], [1, 2]] }]', "server.targets[0].gpus: GPU 1 is in two"),
    ('targets = [{ target = "ssh://h", gpus = [[0], []] }]', "server.targets[0].gpus: [] is not a non-empty"),
    ('targets = ["local", { target = "ssh://h", port = 70000 }]', "server.targets[1].port: 70000 is not a TCP"),
    ('targets = ["ssh://h", { target = "ssh://h" }]', "server.targets: ssh://h is listed twice"),
    ('targets = [{ target = "ssh://h", flags = { tp_size = 2 } }]',
     "server.targets[0].flags.tp_size: not a per-target flag: it changes the rows' `server` fingerprint"),
    ('targets = [{ target = "ssh://h", flags = { extra_args = ["--x"] } }]', "flags.extra_args: not a per-target"),
    ('targets = [{ target = "ssh://h", flags = { backend = "sglang" } }]', "flags.backend: not a per-target flag"),
    ('targets = [{ target = "ssh://h", flags = { max_running_requests = 0 } }]',
     "server.targets[0].flags.max_running_requests: 0 is not a positive integer"),
    ('targets = [{ target = "ssh://h", flags = { maxrunning = 1 } }]', "server.targets[0].flags.maxrunning: unknown"),
    ('tp_size = 2\ntargets = [{ target = "ssh://h", gpus = [[0, 1], [2]] }]',
     "server.targets: ssh://h server 1 (GPUs [2]): server config: gpus=(2,): tp_size=2 needs at least"),
    ('targets = [{ target = "ftp://h" }]', "server.targets: bad target 'ftp://h'"),
])
def test_bad_entries_name_the_key(tmp_path: Path, server: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, server)
    assert message in str(exc.value) and str(tmp_path / "p.toml") in str(exc.value)


def test_several_running_servers(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "", 'server_url = ["http://a:30000/", "http://b:30000"]')
    assert cfg.server_urls == ("http://a:30000", "http://b:30000")  # type: ignore[attr-defined]
    assert cfg.server_url == "http://a:30000" and cfg.servers() == []  # type: ignore[attr-defined]
    one = _load(tmp_path, "", 'server_url = "http://a:1"')
    assert one.server_urls == ("http://a:1",)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"run.server_url: 'http://a:1/' is given twice"):
        _load(tmp_path, "", 'server_url = ["http://a:1", "http://a:1/"]')
    over = one.with_overrides(RunSettings.from_mapping({"server_url": ["http://c:2", "http://d:3/"]}))  # type: ignore[attr-defined]
    assert over.server_urls == ("http://c:2", "http://d:3") and over.server_url == "http://c:2"
    assert RunSettings.from_mapping({"server_url": ["http://c:2"]}).as_kwargs() == {"server_url": ["http://c:2"]}
    assert over.for_url("http://d:3").server_urls == ("http://d:3",)
    with pytest.raises(ConfigError, match="override: server_url: 'c:2' is not an http"):
        one.with_overrides(RunSettings(server_url=("http://c:1", "c:2")))  # type: ignore[attr-defined]


def test_an_override_that_breaks_a_server_names_it(tmp_path: Path) -> None:
    cfg = _load(tmp_path, 'targets = [{ target = "ssh://h", gpus = [[0], [1]] }]')
    with pytest.raises(ConfigError, match=r"override: server.targets: ssh://h server 0 \(GPUs \[0\]\).*tp_size=2"):
        cfg.with_overrides(RunSettings(tp_size=2))  # type: ignore[attr-defined]


NODES = '["ssh://u@gpu1", "ssh://u@gpu2"]'


def test_a_server_over_two_nodes_derives_its_shape(tmp_path: Path) -> None:
    cfg = _load(tmp_path, f'targets = [{{ nodes = {NODES}, gpus = [0, 1, 2, 3, 4, 5, 6, 7], tp_size = 16, '
                          'port = 31000, dist_init_host = "10.0.0.1", dist_init_port = 25000 }]')
    (slot,) = cfg.servers()  # type: ignore[attr-defined]
    assert (slot.target, slot.nodes, slot.port) == ("ssh://u@gpu1", ("ssh://u@gpu1", "ssh://u@gpu2"), 31000)
    assert slot.label((0, 1)) == "gpu1+gpu2[gpu 0,1]"
    one = cfg.for_server(slot)  # type: ignore[attr-defined]
    launch = one.server.launch
    assert (launch.tp_size, launch.nnodes, launch.peer_nodes, launch.gpus_per_node) == (16, 2, ("ssh://u@gpu2",), 8)
    assert launch.gpu_indexes() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (one.server.dist_init_host, one.server.dist_init_port) == ("10.0.0.1", 25000)
    assert cfg.hosts() == ["ssh://u@gpu1", "ssh://u@gpu2"]  # type: ignore[attr-defined]
    # the command line of node 1: the same command, its own --node-rank
    from dataclasses import replace

    from tasks.server import build_command
    node1 = replace(launch, dist_init_addr="10.0.0.1:25000").for_node(1)
    argv = build_command(node1, None)
    assert argv[argv.index("--nnodes"):argv.index("--nnodes") + 6] == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:25000"]
    assert argv[argv.index("--tp-size") + 1] == "16"


def test_a_server_over_nodes_with_pipeline_parallelism_counts_its_gpus_per_node(tmp_path: Path) -> None:
    cfg = _load(tmp_path, f'extra_args = ["--pp-size", "2"]\ntargets = [{{ nodes = {NODES}, tp_size = 4 }}]')
    launch = cfg.for_server(cfg.servers()[0]).server.launch  # type: ignore[attr-defined]
    assert (launch.pp_size, launch.gpu_indexes()) == (2, [0, 1, 2, 3])


@pytest.mark.parametrize(("server", "message"), [
    (f'targets = [{{ nodes = {NODES}, tp_size = 3 }}]',
     "server.targets[0].tp_size: tp_size=3: tp_size x pp_size = 3 is not a multiple of the 2 nodes"),
    (f'targets = [{{ nodes = {NODES}, gpus = [0, 1, 2], tp_size = 8 }}]',
     "server.targets[0].gpus: gpus=(0, 1, 2): tp_size=8 x pp_size=1 over 2 nodes needs 4 GPUs on each node"),
    (f'extra_args = ["--nnodes", "2"]\ntargets = [{{ nodes = {NODES}, tp_size = 2 }}]',
     "server.extra_args: server config: extra_args contains --nnodes, which the launcher sets itself"),
    (f'extra_args = ["--dist-init-addr=h:1"]\ntargets = [{{ nodes = {NODES}, tp_size = 2 }}]',
     "server.extra_args: server config: extra_args contains --dist-init-addr"),
    (f'extra_args = ["--dp-size", "2"]\ntargets = [{{ nodes = {NODES}, tp_size = 2 }}]',
     "server.extra_args: extra_args=('--dp-size', '2'): --dp-size 2 over 2 nodes: SGLang has no multi-node"),
    ('targets = [{ nodes = ["ssh://u@gpu1"], tp_size = 2 }]', "server.targets[0].nodes: a list of at least 2"),
    (f'targets = [{{ target = "ssh://u@gpu1", nodes = {NODES} }}]', "server.targets[0]: `target` or `nodes`, not both"),
    (f'targets = ["ssh://u@gpu2", {{ nodes = {NODES}, tp_size = 2 }}]', "server.targets: ssh://u@gpu2 is listed twice"),
    (f'targets = [{{ nodes = {NODES}, gpus = [[0], [1]], tp_size = 2 }}]',
     "server.targets[0].gpus: one server spans the nodes: one GPU list"),
    (f'tp_size = 1\ntargets = [{{ nodes = {NODES}, tp_size = 2 }}]',
     "server.targets[0].tp_size: 2 differs from server.tp_size 1"),
    (f'targets = [{{ nodes = {NODES}, tp_size = 2, dist_init_port = 70000 }}]',
     "server.targets[0].dist_init_port: 70000 is not a TCP port"),
    (f'targets = [{{ nodes = {NODES}, tp_size = 2, dist_init_host = "h:1" }}]',
     "server.targets[0].dist_init_host: 'h:1' is not a host name"),
    ('targets = [{ target = "ssh://u@gpu1", dist_init_port = 25000 }]',
     "server.targets[0].dist_init_port: only a server over several `nodes` has a --dist-init-addr"),
    ('targets = [{ nodes = ["ssh://u@gpu1", "ftp://x"], tp_size = 2 }]', "server.targets[0].nodes[1]: bad target"),
])
def test_bad_node_shapes_are_refused_at_load_naming_the_key(tmp_path: Path, server: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, server)
    assert str(exc.value).startswith(f"{tmp_path / 'p.toml'}: ") and message in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)
