"""Partition configs: every bundled one loads; bad ones fail naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import ConfigError, Overrides, list_partitions, load_partition, project_root

ROOT = project_root()


def test_bundled_partitions_load_and_cover_every_sample() -> None:
    assert set(list_partitions()) >= {"all", "demo", "glaive_like", "opencode_like"}
    samples = {p.name.split(".")[0] for p in (ROOT / "data" / "samples").glob("*.jsonl")}
    all_cfg = load_partition("all")
    assert set(all_cfg.datasets) == samples
    assert all(p.is_file() and p.is_absolute() for p in all_cfg.datasets.values())
    assert all_cfg.versioned is True and all_cfg.server.backend == "sglang"
    for name in samples:
        cfg = load_partition(name)
        assert list(cfg.datasets) == [name]
        assert cfg.output_root == ROOT / "data" / "out" / name
    demo = load_partition("demo")
    assert demo.server.backend == "emulator" and demo.sim_gpus is not None
    assert demo.sim_gpus.count == 8 and demo.versioned is False
    assert demo.model_path == str(ROOT / "data" / "models" / "demo")


def test_load_by_path_resolves_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    f = tmp_path / "p.toml"
    f.write_text(f'[datasets]\nx = "in.jsonl"\n[model]\npath = "{ROOT}/data/models/demo"\n'
                 '[server]\nbackend = "emulator"\n[output]\nroot = "o"\n')
    cfg = load_partition(f)
    assert cfg.name == "p" and cfg.datasets == {"x": tmp_path / "in.jsonl"}
    assert cfg.output_root == tmp_path / "o"


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "in.jsonl").write_text("{}\n")
    f = tmp_path / "bad.toml"
    f.write_text(body)
    return f


BASE = '[datasets]\nx = "in.jsonl"\n[model]\npath = "m"\n'


@pytest.mark.parametrize(
    ("body", "key", "fragment"),
    [
        ('[model]\npath = "m"\n', "[datasets]", "at least one"),
        ('[datasets]\nx = "nope.jsonl"\n[model]\npath = "m"\n', "datasets.x", "does not exist"),
        ('[datasets]\nx = "in.jsonl"\n', "model.path", "required"),
        (BASE + '[server]\nbackend = "vllm"\n', "server.backend", "not one of sglang, emulator"),
        (BASE + "[server]\nmem_fraction_static = 1.2\n", "server.mem_fraction_static", "fraction"),
        (BASE + "[server]\nport = 70000\n", "server.port", "not a TCP port"),
        (BASE + "[server]\ntargets = []\n", "server.targets", "non-empty"),
        (BASE + '[server]\nextra_args = ["--api-key", "x"]\n', "server.extra_args", "never put --api-key"),
        (BASE + "[server]\ntp_szie = 2\n", "server.tp_szie", "unknown key"),
        (BASE + "[run]\nshard_size = 0\n", "run.shard_size", "not a positive integer"),
        (BASE + "[run]\nconcurrency = true\n", "run.concurrency", "not a positive integer"),
        (BASE + '[model]\n', "[model]", ""),  # duplicate table: TOML error names the file
        (BASE + "[sim_gpus]\ncount = 2\n", "sim_gpus", "need server.backend"),
        (BASE + "[output]\nversioned = 1\n", "output.versioned", "true or false"),
        (BASE + "bogus = 1\n", "bogus", "unknown key"),
        ('[datasets]\nx = "in.jsonl"\n[model]\npath = "m"\nreasoning_parser = "nope"\n',
         "model.reasoning_parser", "unknown reasoning parser"),
    ],
)
def test_invalid_configs_name_file_and_key(tmp_path: Path, body: str, key: str, fragment: str) -> None:
    f = _write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_partition(f)
    msg = str(err.value)
    assert msg.startswith(str(f.resolve()) if "cannot read" not in msg else str(f))
    if fragment:
        assert f"{key}: " in msg and fragment in msg


def test_unknown_partition_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"nosuch\.toml: no such partition config \(known partitions: all, demo"):
        load_partition("nosuch")


def test_emulator_model_dir_must_exist_locally(tmp_path: Path) -> None:
    f = _write(tmp_path, BASE + '[server]\nbackend = "emulator"\n')
    with pytest.raises(ConfigError, match=r"model\.path: .*/m has no config\.json"):
        load_partition(f)
    # for sglang the model lives on the target host: not checked here
    assert load_partition(_write(tmp_path, BASE)).model_path == str(tmp_path / "m")


def test_overrides(tmp_path: Path) -> None:
    cfg = load_partition("all")
    inp = tmp_path / "my_set.jsonl"
    inp.write_text("{}\n")
    o = cfg.with_overrides(Overrides(inputs=(str(inp),), out=str(tmp_path / "out"), backend="emulator",
                                     shard_size=7, concurrency=3, mem_fraction_static=0.8,
                                     reasoning_parser="deepseek-r1", server_url="http://127.0.0.1:9/"))
    assert dict(o.datasets) == {"my_set": inp}
    assert o.output_root == tmp_path / "out" and o.versioned is False
    assert (o.server.backend, o.shard_size, o.concurrency) == ("emulator", 7, 3)
    assert o.server.mem_fraction_static == 0.8 and o.reasoning_parser == "deepseek-r1"
    assert o.server_url == "http://127.0.0.1:9"
    assert cfg.shard_size == 500  # the loaded config is not changed
    for kwargs, fragment in [
        ({"inputs": (str(tmp_path / "missing.jsonl"),)}, "--input .*missing.jsonl: no such file"),
        ({"backend": "trt"}, "override: backend: 'trt' is not one of"),
        ({"shard_size": -1}, "override: shard_size: -1 is not a positive integer"),
        ({"mem_fraction_static": 0.0}, "override: mem_fraction_static"),
        ({"server_url": "localhost:30000"}, "override: server_url: 'localhost:30000' is not an http"),
        ({"reasoning_parser": "bogus"}, "unknown reasoning parser 'bogus'"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            cfg.with_overrides(Overrides(**kwargs))


def test_api_key_from_env_never_in_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_partition("demo")
    monkeypatch.setenv("DATAGEN_API_KEY", "sk-secret-123")
    assert cfg.api_key() == "sk-secret-123"
    assert "sk-secret-123" not in repr(cfg.to_summary())
    monkeypatch.delenv("DATAGEN_API_KEY")
    assert cfg.api_key() is None


def test_max_relaunches_documented_as_one_budget_per_run() -> None:
    # The flow counts relaunches once per run, across datasets (tests/test_flow_recovery.py): the
    # docs and every bundled partition that sets the key must say so, not suggest a per-dataset count.
    import re

    import tasks.config

    doc = " ".join((tasks.config.__doc__ or "").split())
    assert "``run.max_relaunches`` is a budget per run, not per dataset" in doc
    assert "all of the partition's datasets share it" in doc
    files = sorted((ROOT / "deployments").glob("*.toml"))
    with_key = [f for f in files if re.search(r"^max_relaunches\s*=", f.read_text(), re.M)]
    assert {f.stem for f in with_key} >= {"all", "demo", "glaive_like", "opencode_like"}
    for f in with_key:
        (line,) = [ln for ln in f.read_text().splitlines() if ln.startswith("max_relaunches")]
        assert "# server relaunches per run: one budget shared by all datasets" in line, f.name
        assert load_partition(f.stem).max_relaunches == 3
