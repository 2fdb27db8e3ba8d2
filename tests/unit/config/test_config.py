"""Partition configs: every bundled one loads; bad ones fail naming the file and the key."""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from datagen.cmd_run import build_parser, overrides_of
from tasks.config import (
    ConfigError,
    RunSettings,
    ServerSettings,
    list_partitions,
    load_partition,
    project_root,
)
from tasks.config._model import NOT_SERVER_KEYS, SERVER_KEYS, dataset_name_of
from tasks.config._sampling import SAMPLING_KEYS
from tasks.inference import TruncationPolicy
from tasks.run import RunContext, RunPlan
from tasks.server import ServerConfig
from tests.support.common import free_port

ROOT = project_root()


def test_bundled_partitions_load_and_cover_every_sample() -> None:
    assert set(list_partitions()) >= {"all", "demo", "glaive_like", "opencode_like"}
    samples = {p.name.split(".")[0] for p in (ROOT / "data" / "samples").glob("*.jsonl")}
    all_cfg = load_partition("all")
    assert set(all_cfg.datasets) == samples
    assert all(p.is_file() and p.is_absolute() for p in all_cfg.datasets.values())
    assert all_cfg.versioned is True and all_cfg.server.launch.backend == "sglang"
    for name in samples:
        cfg = load_partition(name)
        assert list(cfg.datasets) == [name]
        assert cfg.output_root == ROOT / "data" / "out" / name
    demo = load_partition("demo")
    assert demo.server.launch.backend == "emulator" and demo.sim_gpus is not None
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
        ('[datasets]\nx = "nope.jsonl"\n[model]\npath = "m"\n', "datasets.x", "no such file"),
        ('[datasets]\nx = "in.jsonl"\n', "model.path", "required"),
        (BASE + '[server]\nbackend = "vllm"\n', "server.backend", "not one of sglang, emulator"),
        (BASE + "[server]\nmem_fraction_static = 1.2\n", "server.mem_fraction_static", "fraction"),
        (BASE + "[server]\nport = 70000\n", "server.port", "not a TCP port"),
        (BASE + "[server]\ntargets = []\n", "server.targets", "non-empty"),
        (BASE + '[server]\nextra_args = ["--api-key", "x"]\n', "server.extra_args", "never put --api-key"),
        (BASE + "[server]\ntp_szie = 2\n", "server.tp_szie", "unknown key"),
        (BASE + "[run]\nshard_size = 0\n", "run.shard_size", "not a positive integer"),
        (BASE + "[run]\nconcurrency = true\n", "run.concurrency", "not a positive integer"),
        (BASE + '[run]\norder = "lpm"\n', "run.order", "'lpm' is not one of prefix, input"),
        (BASE + "[run]\norder_window = 0\n", "run.order_window", "not a positive integer"),
        (BASE + "[run]\nprice_per_gpu_hour = -2\n", "run.price_per_gpu_hour", "not a finite non-negative number"),
        (BASE + "[run]\nsamples = 1000000000\n", "run.samples", "1000000000 is over the limit of 1,024"),
        (BASE + "[run]\nshard_size = 10000000\n", "run.shard_size", "10000000 is over the limit of 1,000,000"),
        (BASE + "[run]\nhygiene_grace_s = nan\n", "run.hygiene_grace_s", "nan is not a finite non-negative number"),
        (BASE + "[run]\nhang_timeout_s = inf\n", "run.hang_timeout_s", "inf is not a finite non-negative number"),
        (BASE + "[run]\ncapacity_probe_tokens = -1\n", "run.capacity_probe_tokens", "-1 is not a non-negative"),
        (BASE + "[run]\ngoodput_warn_below = 30\n", "run.goodput_warn_below",
         "30 is not a share between 0 and 1 (0 turns it off)"),
        (BASE + "[run]\ngoodput_window_s = -5\n", "run.goodput_window_s", "-5 is not a finite non-negative number"),
        (BASE + '[model]\n', "[model]", ""),  # duplicate table: TOML error names the file
        (BASE + "[sim_gpus]\ncount = 2\n", "sim_gpus", "need server.backend"),
        (BASE + "[run]\nserver_url = 5\n", "run.server_url", "5 is neither an http(s) URL nor a list of them"),
        (BASE + f'[server]\ntargets = "ssh://{"h" * 600}"\n', "server.targets[0]",
         "a target of 606 characters; at most 512"),
        (BASE + f"[server]\ntargets = {[f'ssh://h{i}' for i in range(300)]}\n".replace("'", '"'),
         "server.targets", "300 targets; at most 256"),
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


def test_run_order_reaches_the_inference_settings(tmp_path: Path) -> None:
    from tasks.run import RunContext

    assert (load_partition(_write(tmp_path, BASE)).order, load_partition(_write(tmp_path, BASE)).order_window) == (
        "prefix", None)
    cfg = load_partition(_write(tmp_path, BASE + '[run]\norder = "input"\norder_window = 64\n'))
    settings = RunContext.build(cfg, None, None).inference()  # type: ignore[arg-type]
    assert (settings.order, settings.order_window, settings.window_for(32)) == ("input", 64, 1)


def test_price_per_gpu_hour_is_optional(tmp_path: Path) -> None:
    assert load_partition(_write(tmp_path, BASE)).price_per_gpu_hour is None
    assert load_partition(_write(tmp_path, BASE + "[run]\nprice_per_gpu_hour = 2.5\n")).price_per_gpu_hour == 2.5


def test_unknown_partition_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"nosuch\.toml: no such partition config \(known partitions: adhoc, all, demo"):
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
    o = cfg.with_overrides(RunSettings(inputs=(str(inp),), out=str(tmp_path / "out"), backend="emulator",
                                     shard_size=7, concurrency=3, mem_fraction_static=0.8,
                                     reasoning_parser="deepseek-r1", server_url="http://127.0.0.1:9/"))
    assert dict(o.datasets) == {"my_set": inp}
    assert o.output_root == tmp_path / "out" and o.versioned is False
    assert (o.server.launch.backend, o.shard_size, o.concurrency) == ("emulator", 7, 3)
    assert o.server.launch.mem_fraction_static == 0.8 and o.reasoning_parser == "deepseek-r1"
    assert o.server_url == "http://127.0.0.1:9"
    assert cfg.shard_size == 500  # the loaded config is not changed
    for kwargs, fragment in [
        ({"inputs": (str(tmp_path / "missing.jsonl"),)}, "--input .*missing.jsonl: no such file"),
        ({"backend": "trt"}, "override: backend: 'trt' is not one of"),
        ({"shard_size": -1}, "override: shard_size: -1 is not a positive integer"),
        ({"mem_fraction_static": 0.0}, "override: mem_fraction_static"),
        ({"server_url": "localhost:30000"}, "override: server_url: 'localhost:30000' is not an http"),
        ({"reasoning_parser": "bogus"}, "unknown reasoning parser 'bogus'"),
        ({"samples": 0}, "override: samples: 0 is not a positive integer"),
        ({"regenerate": "first"}, "override: regenerate: 'first' is not one of 'last', 'all'"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            cfg.with_overrides(RunSettings(**kwargs))


def test_samples_and_regenerate_from_the_file_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("{}\n")
    cfg = load_partition(_write(tmp_path, BASE))
    assert (cfg.samples, cfg.regenerate) == (1, "last")
    cfg = load_partition(_write(tmp_path, BASE + '[run]\nsamples = 4\nregenerate = "all"\n'))
    assert (cfg.samples, cfg.regenerate) == (4, "all")
    assert cfg.to_summary()["samples"] == 4 and cfg.to_summary()["regenerate"] == "all"
    o = cfg.with_overrides(RunSettings(samples=2, regenerate="last"))
    assert (o.samples, o.regenerate) == (2, "last")
    for body, fragment in [("[run]\nsamples = 0\n", "run.samples: 0 is not a positive integer"),
                           ('[run]\nsamples = "3"\n', "run.samples: '3' is not a positive integer"),
                           ('[run]\nregenerate = "every"\n', "run.regenerate: 'every' is not one of 'last', 'all'")]:
        with pytest.raises(ConfigError, match=fragment):
            load_partition(_write(tmp_path, BASE + body))


def test_api_key_from_env_never_in_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_partition("demo")
    monkeypatch.setenv("DATAGEN_API_KEY", "sk-secret-123")
    assert cfg.api_key() == "sk-secret-123"
    assert "sk-secret-123" not in repr(cfg.to_summary())
    monkeypatch.delenv("DATAGEN_API_KEY")
    assert cfg.api_key() is None


def test_max_relaunches_documented_as_one_budget_per_server() -> None:
    # The flow counts relaunches once per server for the whole run, across datasets
    # (tests/e2e/test_flow_recovery.py): the docs and every bundled partition that sets the key must
    # say so, not suggest a per-dataset count.
    doc = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert "`run.max_relaunches` is a budget per server, not per dataset" in doc
    assert "all of the partition's datasets share it" in doc
    files = sorted((ROOT / "deployments").glob("*.toml"))
    with_key = [f for f in files if re.search(r"^max_relaunches\s*=", f.read_text(), re.M)]
    assert {f.stem for f in with_key} >= {"all", "demo", "glaive_like", "opencode_like"}
    for f in with_key:
        (line,) = [ln for ln in f.read_text().splitlines() if ln.startswith("max_relaunches")]
        assert "# relaunches per server: one budget shared by all datasets" in line, f.name
        assert load_partition(f.stem).max_relaunches == 3


def test_dataset_name_of_an_input_keeps_its_dots() -> None:
    assert dataset_name_of(Path("/x/my.data.v2.jsonl")) == "my.data.v2"
    assert dataset_name_of(Path("glaive.PARQUET")) == "glaive"
    assert dataset_name_of(Path("plain.ndjson")) == "plain"
    assert dataset_name_of(Path("notes.txt")) == "notes"


def test_every_flow_parameter_is_an_override_and_every_override_a_flow_parameter() -> None:
    from flows.datagen import datagen

    params = [p for p in inspect.signature(datagen.fn).parameters if p != "partition"]
    assert params == list(RunSettings.names())
    assert RunSettings.from_mapping({"shard_size": 7, "inputs": ["a.jsonl"], "out": None, "other": 1}) == RunSettings(
        shard_size=7, inputs=("a.jsonl",))
    assert RunSettings(inputs=("a.jsonl",), backend="emulator").as_kwargs() == {"inputs": ["a.jsonl"],
                                                                            "backend": "emulator"}


def test_cli_options_are_the_overrides() -> None:
    args = build_parser().parse_args(["--input", "x.jsonl", "--shard-size", "3", "--mem-fraction-static", "0.7",
                                      "--reasoning-parser", "qwen3", "--samples", "4", "--regenerate", "all"])
    assert overrides_of(args) == RunSettings(inputs=("x.jsonl",), shard_size=3, mem_fraction_static=0.7,
                                           reasoning_parser="qwen3", samples=4, regenerate="all")
    dests = {a.dest for a in build_parser()._actions} - {"help", "partition"}
    assert dests == set(RunSettings.names())


def test_two_inputs_with_one_name_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "alpha.jsonl", tmp_path / "alpha.parquet"
    a.write_text("{}\n")
    pq.write_table(pa.table({"prompt": ["hi"]}), b)
    with pytest.raises(ConfigError, match=r"override: --input .*alpha\.parquet: a second input named 'alpha'"):
        load_partition("all").with_overrides(RunSettings(inputs=(str(a), str(b))))


def test_unknown_server_key_names_the_file_and_the_key(tmp_path: Path) -> None:
    f = _write(tmp_path, BASE + "[server]\nmem_fraction_statc = 0.8\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: server\.mem_fraction_statc: unknown key"):
        load_partition(f)


def test_server_keys_are_server_config_fields_and_the_partition_own() -> None:
    launch = {f.name for f in dataclasses.fields(ServerConfig)} - NOT_SERVER_KEYS
    # one server's own (PartitionConfig.for_server), never a [server] key
    own = {f.name for f in dataclasses.fields(ServerSettings)} - {"launch", "target_servers", "nodes",
                                                                  "dist_init_host", "dist_init_port"}
    assert SERVER_KEYS == launch | own
    assert NOT_SERVER_KEYS <= {f.name for f in dataclasses.fields(ServerConfig)}


def test_server_config_carries_every_server_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _write(tmp_path, BASE + """[server]
backend = "emulator"
targets = ["local"]
tp_size = 2
host = "127.0.0.2"
port = 31000
mem_fraction_static = 0.77
served_model_name = "served"
context_length = 4096
max_running_requests = 17
chunked_prefill_size = 512
trust_remote_code = true
enable_hierarchical_cache = true
hicache_size = 3
hicache_ratio = 1.5
speculative_algorithm = "EAGLE3"
speculative_draft_model_path = "/models/draft"
speculative_num_steps = 3
speculative_eagle_topk = 1
speculative_num_draft_tokens = 4
gpus = [3, 1]
extra_args = ["--emu-output-tokens", "9"]
env = {FOO = "bar"}
api_key_secret = "no-such-block"
hub_token_secret = "no-such-block-either"
launch_deadline_s = 60
python = "/usr/bin/python3"
allow_unauthenticated_bind = true
""")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("DATAGEN_API_KEY", "sk-k")
    monkeypatch.setenv("HF_TOKEN", "hf-t")
    # No Prefect API answers here (a closed loopback port): the secret blocks fall back to the
    # environment at once, without Prefect starting a temporary server for the lookup.
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        cfg = load_partition(f)
        scfg = cfg.server_config(30123, "qwen3")
    launch_keys = SERVER_KEYS - {f.name for f in dataclasses.fields(ServerSettings)}
    assert launch_keys == {f.name for f in dataclasses.fields(ServerConfig)} - NOT_SERVER_KEYS
    written = tomllib.loads(f.read_text())["server"]
    assert set(written) == SERVER_KEYS, "the test must set every [server] key"
    for name in launch_keys:
        want = written[name]
        want = tuple(want) if isinstance(want, list) else dict(want, HF_TOKEN="hf-t") if name == "env" else want
        assert getattr(scfg, name) == want, name
    assert (scfg.model_path, scfg.port, scfg.reasoning_parser, scfg.api_key) == (cfg.model_path, 30123, "qwen3", "sk-k")
    assert (cfg.server.port, cfg.server.launch_deadline_s, cfg.server.targets) == (31000, 60.0, ("local",))
    assert cfg.server.allow_unauthenticated_bind is True
    assert cfg.server_gpus() == [3, 1]


def test_bad_launch_setting_names_the_file_and_the_key(tmp_path: Path) -> None:
    f = _write(tmp_path, BASE + '[server]\nspeculative_num_steps = 3\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: server\.speculative_algorithm: .*speculative_algorithm"):
        load_partition(f)


def test_hicache_size_is_whole_gigabytes(tmp_path: Path) -> None:
    hicache = '[server]\nenable_hierarchical_cache = true\nhicache_size = '
    f = _write(tmp_path, BASE + hicache + '2.5\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: server\.hicache_size: .*hicache_size=2\.5"):
        load_partition(f)
    whole = load_partition(_write(tmp_path, BASE + hicache + '4.0\n')).server_config(30123, None)
    assert whole.hicache_size == 4 and isinstance(whole.hicache_size, int)


def test_server_fingerprint_ignores_port_fraction_and_parser(tmp_path: Path) -> None:
    cfg = load_partition("demo")
    same = dataclasses.replace(cfg, reasoning_parser="deepseek-r1", server=dataclasses.replace(
        cfg.server, port=31000, launch=dataclasses.replace(cfg.server.launch, mem_fraction_static=0.6)))
    assert same.server_fingerprint() == cfg.server_fingerprint()
    assert cfg.server_fingerprint().startswith("emulator:")
    launch = dataclasses.replace(cfg.server.launch, tp_size=cfg.server.launch.tp_size + 1)
    other = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, launch=launch))
    assert other.server_fingerprint() != cfg.server_fingerprint()
    shared = cfg.with_overrides(RunSettings(server_url="http://127.0.0.1:9/"))
    assert shared.server_fingerprint() == "external:http://127.0.0.1:9"


def _config_error(tmp_path: Path, body: str) -> str:
    f = _write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_partition(f)
    return str(err.value).removeprefix(f"{f.resolve()}: ")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[datasets]\n_journal = "in.jsonl"\n[model]\npath = "m"\n',
         "datasets._journal: dataset name '_journal' must be 1-128 of [A-Za-z0-9._-], not starting with '_' or '.'"),
        (BASE + "[validation]\nreasoning_missing_max_rat = 0.1\n",
         "validation.reasoning_missing_max_rat: unknown validation threshold 'reasoning_missing_max_rat'; valid keys: "),
        (BASE + '[validation]\nmin_rows = "ten"\n',
         "validation.min_rows: validation threshold 'min_rows' must be an integer >= 0, not 'ten'"),
        (BASE + "[server]\ntp_size = 2\ngpus = [0, 0]\n",
         "server.gpus: server config: gpus=(0, 0): must be distinct non-negative GPU indexes"),
        (BASE + '[server]\nextra_args = ["--tp-size", "2"]\n',
         "server.extra_args: server config: extra_args contains --tp-size, which the launcher sets itself; "
         "use the config field instead"),
        (BASE + '[sampling]\ntemperature = "hot"\n', "sampling.temperature: 'hot' is not a number"),
        (BASE + "[sampling]\nmax_new_tokens = -64\n", "sampling.max_new_tokens: -64 must be at least 0"),
        (BASE + "[sampling]\nseed = 7\n", "sampling.seed: unknown key (SGLang calls it sampling_seed)"),
        (BASE + "[sampling]\ntempreature = 0.6\n", "sampling.tempreature: unknown key (SGLang's sampling parameters: "),
        (BASE + "[sampling]\ntop_p = 0\n", "sampling.top_p: 0 is out of range (0, 1]"),
        (BASE + "[sampling]\ntop_k = 0\n", "sampling.top_k: 0 must be -1 (the whole vocabulary) or at least 1"),
        (BASE + "[sampling]\nn = 2\n", "sampling.n: 2 must be 1 (for several samples per prompt set run.samples)"),
        (BASE + '[sampling]\nstop = ["a", 3]\n', "sampling.stop: ['a', 3] must be a non-empty string or a list of them"),
        (BASE + '[sampling]\nstop_regex = "(a"\n', "sampling.stop_regex: '(a' pattern '(a' is not a regular expression: "),
        (BASE + "[sampling]\nmin_new_tokens = 50\nmax_new_tokens = 10\n",
         "sampling.min_new_tokens: 50 is above sampling.max_new_tokens (10)"),
        (BASE + '[sampling]\nregex = "a+"\njson_schema = "{}"\n',
         "sampling.regex: only one of json_schema, regex, ebnf, structural_tag may be set (also set: json_schema)"),
        (BASE + '[server]\npython = "/no/such"\n',
         "server.python: /no/such is not an executable on this host (the interpreter that has SGLang, or the emulator's)"),
        (BASE + '[server]\nallow_unauthenticated_bind = "yes"\n', "server.allow_unauthenticated_bind: must be true or false"),
    ],
)
def test_configuration_errors_are_found_at_load_naming_file_and_key(tmp_path: Path, body: str, message: str) -> None:
    assert _config_error(tmp_path, body).startswith(message)


def test_every_sglang_sampling_parameter_is_accepted(tmp_path: Path) -> None:
    f = _write(tmp_path, BASE + """[sampling]
max_new_tokens = 64
min_new_tokens = 1
stop = ["</s>"]
stop_token_ids = [2]
stop_regex = "\\\\n\\\\n"
temperature = 0.6
top_p = 0.95
top_k = -1
min_p = 0.05
frequency_penalty = -0.5
presence_penalty = 0.5
repetition_penalty = 1.1
n = 1
beam_width = 1
json_schema = "{}"
ignore_eos = false
skip_special_tokens = true
spaces_between_special_tokens = true
no_stop_trim = false
stream_interval = 1
logit_bias = {"42" = -100.0}
sampling_seed = 7
custom_params = {a = 1}
watermark = {}
""")
    cfg = load_partition(f)
    assert cfg.sampling["sampling_seed"] == 7 and cfg.sampling["logit_bias"] == {"42": -100.0}
    assert set(cfg.sampling) == SAMPLING_KEYS - {"regex", "ebnf", "structural_tag"}


def test_input_and_output_paths_are_checked_at_load(tmp_path: Path) -> None:
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "notes.txt").write_text("{}\n")
    (tmp_path / "file").write_text("")
    for path, message in [
        ("dir.jsonl", f"datasets.x: {tmp_path}/dir.jsonl: is a directory; give a dataset file (.jsonl or .parquet)"),
        ("bad.parquet", f"datasets.x: {tmp_path}/bad.parquet: not a readable Parquet file: "),
        ("notes.txt", f"datasets.x: {tmp_path}/notes.txt: unsupported dataset format (expected .jsonl, .json, "
                      ".ndjson or .parquet)"),
    ]:
        assert _config_error(tmp_path, f'[datasets]\nx = "{path}"\n[model]\npath = "m"\n').startswith(message)
    assert _config_error(tmp_path, BASE + '[output]\nroot = "file/out"\n') == (
        f"output.root: {tmp_path}/file/out: {tmp_path}/file is not a directory; choose another output directory")
    assert _config_error(tmp_path, BASE + '[output]\nroot = "/sys/datagen-out"\n') == (
        "output.root: /sys/datagen-out: cannot write in /sys (Operation not permitted); choose another output "
        "directory")
    cfg = load_partition("all")
    with pytest.raises(ConfigError, match=rf"^override: --input {tmp_path}/dir\.jsonl: is a directory; give a dataset file"):
        cfg.with_overrides(RunSettings(inputs=(str(tmp_path / "dir.jsonl"),)))
    with pytest.raises(ConfigError, match=r"^override: out: /sys/x/y: cannot write in /sys"):
        cfg.with_overrides(RunSettings(out="/sys/x/y"))
    journal = tmp_path / "_journal.jsonl"
    journal.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"^override: --input .*_journal\.jsonl: dataset name '_journal' must be"):
        cfg.with_overrides(RunSettings(inputs=(str(journal),)))
    assert not list(tmp_path.glob(".datagen-write-test-*"))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-host.example"])
def test_a_routable_host_without_an_api_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       host: str) -> None:
    monkeypatch.delenv("DATAGEN_API_KEY", raising=False)
    body = BASE + f'[server]\nhost = "{host}"\n'
    assert _config_error(tmp_path, body) == (
        f"server.host: {host!r} is reachable from other machines but the server would have no API key "
        "(no server.api_key_secret and $DATAGEN_API_KEY is unset); set server.api_key_secret or "
        "$DATAGEN_API_KEY, bind 127.0.0.1, or set server.allow_unauthenticated_bind = true to accept an open server")
    assert load_partition(_write(tmp_path, body + "allow_unauthenticated_bind = true\n")).server.launch.host == host
    monkeypatch.setenv("DATAGEN_API_KEY", "sk-1")
    assert load_partition(_write(tmp_path, body)).api_key() == "sk-1"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.9", "::1", "localhost"])
def test_a_loopback_host_needs_no_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.delenv("DATAGEN_API_KEY", raising=False)
    cfg = load_partition(_write(tmp_path, BASE + f'[server]\nhost = "{host}"\n'))
    cfg.check_bind()
    assert cfg.server_config(30000, None).api_key is None


def test_a_secret_block_without_a_value_is_refused_at_launch_for_a_routable_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAGEN_API_KEY", raising=False)
    f = _write(tmp_path, BASE + '[server]\nhost = "0.0.0.0"\napi_key_secret = "no-such-block"\n')
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        cfg = load_partition(f)  # a secret block is named: its value is looked up at launch
        msg = (rf"^{re.escape(str(f.resolve()))}: server\.host: '0\.0\.0\.0' is reachable from other machines but "
               r"the server would have no API key \(the secret block 'no-such-block' has no value and "
               r"\$DATAGEN_API_KEY is unset\)")
        with pytest.raises(ConfigError, match=msg):
            cfg.check_bind()
        with pytest.raises(ConfigError, match=msg):
            cfg.server_config(30000, None)


def test_tp_size_override(tmp_path: Path) -> None:
    cfg = load_partition("all")
    assert cfg.server.launch.tp_size == 8
    assert cfg.with_overrides(RunSettings(tp_size=2)).server_gpus() == [0, 1]
    with pytest.raises(ConfigError, match=r"^override: tp_size: 0 is not a positive integer"):
        cfg.with_overrides(RunSettings(tp_size=0))
    f = _write(tmp_path, BASE + "[server]\ntp_size = 2\ngpus = [4, 5]\n")
    with pytest.raises(ConfigError, match=r"^override: tp_size: server config: gpus=\(4, 5\): tp_size=3 needs"):
        load_partition(f).with_overrides(RunSettings(tp_size=3))


def test_an_input_run_without_a_partition_uses_the_adhoc_partition_on_one_gpu(tmp_path: Path) -> None:
    from datagen.cmd_run import build_parser, partition_of

    inp = tmp_path / "prompts.jsonl"
    inp.write_text("{}\n")
    args = build_parser().parse_args(["--input", str(inp), "--model-path", str(tmp_path)])
    assert partition_of(args) == "adhoc"
    cfg = load_partition(partition_of(args)).with_overrides(RunSettings(inputs=(str(inp),), model_path=str(tmp_path)))
    assert (cfg.server.launch.tp_size, cfg.server_gpus(), cfg.server.port, cfg.versioned) == (1, [0], 0, False)
    assert dict(cfg.datasets) == {"prompts": inp} and cfg.model_path == str(tmp_path)
    args = build_parser().parse_args(["--input", str(inp), "--model-path", str(tmp_path), "--tp-size", "4"])
    assert load_partition(partition_of(args)).with_overrides(RunSettings.from_mapping(vars(args))).server_gpus() == [
        0, 1, 2, 3]
    assert partition_of(build_parser().parse_args([])) == "all"
    assert partition_of(build_parser().parse_args(["--input", str(inp), "--partition", "demo"])) == "demo"


def test_truncation_policy_from_run_truncation_and_the_override(tmp_path: Path) -> None:
    f = _write(tmp_path, BASE + "[sampling]\nmax_new_tokens = 4096\n"
               "[run.truncation]\nretries = 2\nfactor = 1.5\nmax_new_tokens = 16384\n")
    cfg = load_partition(f)
    assert cfg.truncation == TruncationPolicy(retries=2, factor=1.5, max_new_tokens=16384)  # typed at load
    plan = RunPlan(out_dir=tmp_path / "o", root=tmp_path, version=None, sim_gpus=None, log_dir=tmp_path / "l")
    assert RunContext.build(cfg, plan, None).inference().truncation == TruncationPolicy(2, 1.5, 16384)
    assert cfg.with_overrides(RunSettings(truncation_retries=0)).truncation == TruncationPolicy(0, 1.5, 16384)
    assert load_partition(_write(tmp_path, BASE)).truncation == TruncationPolicy()  # off unless set
    assert not TruncationPolicy().enabled
    with pytest.raises(ConfigError, match=r"^override: truncation_retries: -1 is not a non-negative integer"):
        cfg.with_overrides(RunSettings(truncation_retries=-1))
    assert overrides_of(build_parser().parse_args(["--truncation-retries", "3"])) == RunSettings(truncation_retries=3)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[run.truncation]\nretry = 1\n", "run.truncation.retry: unknown key (allowed: factor, max_new_tokens, retries)"),
        ("[run.truncation]\nretries = -1\n", "run.truncation.retries: -1 is not a non-negative integer"),
        ("[run.truncation]\nfactor = 1\n", "run.truncation.factor: 1 is not a number above 1"),
        ('[run.truncation]\nfactor = "x2"\n', "run.truncation.factor: 'x2' is not a number above 1"),
        ("[run.truncation]\nmax_new_tokens = 0\n", "run.truncation.max_new_tokens: 0 is not a positive integer"),
        ("[sampling]\nmax_new_tokens = 4096\n[run.truncation]\nmax_new_tokens = 4096\n",
         "run.truncation.max_new_tokens: 4096 is not above sampling.max_new_tokens (4096): no regeneration could "
         "have a larger budget"),
        ("[run]\ntruncation = 1\n", "run.truncation: must be a table (retries, factor, max_new_tokens)"),
    ],
)
def test_bad_truncation_policy_names_the_file_and_the_key(tmp_path: Path, body: str, message: str) -> None:
    assert _config_error(tmp_path, BASE + body).startswith(message)
