"""Unit tests of tasks.server: config validation, the command line, the classifier, progress parsing."""

from __future__ import annotations

import sys

import pytest

import tasks.server as server
import tasks.server._config as config
import tasks.server._log as server_log
from tasks.server import (
    API_KEY_ENV,
    Failure,
    LaunchFailed,
    ServerConfig,
    ServerConfigError,
    build_command,
    classify_failure,
    effective_fraction,
    launch_argv,
    launch_env,
    parse_progress,
)
from tasks.server._config import log_file_name


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_realistic_command_line_flag_by_flag():
    cfg = ServerConfig(
        model_path="/models/Qwen3-235B-A22B",
        tp_size=8,
        host="127.0.0.1",
        port=30123,
        reasoning_parser="qwen3",
        served_model_name="qwen3-235b",
        context_length=32768,
        max_running_requests=256,
        chunked_prefill_size=8192,
        trust_remote_code=True,
        enable_hierarchical_cache=True,
        hicache_size=120,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/models/Qwen3-235B-eagle3",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        extra_args=("--log-level", "info", "--cuda-graph-max-bs", "128"),
        python="/opt/sglang/bin/python",
    )
    argv = build_command(cfg, 0.875)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert flag_value(argv, "--model-path") == "/models/Qwen3-235B-A22B"
    assert flag_value(argv, "--tp-size") == "8"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "30123"
    assert flag_value(argv, "--mem-fraction-static") == "0.875"
    assert flag_value(argv, "--reasoning-parser") == "qwen3"
    assert flag_value(argv, "--served-model-name") == "qwen3-235b"
    assert flag_value(argv, "--context-length") == "32768"
    assert flag_value(argv, "--max-running-requests") == "256"
    assert flag_value(argv, "--chunked-prefill-size") == "8192"
    assert argv.count("--trust-remote-code") == 1
    assert argv.count("--enable-hierarchical-cache") == 1
    assert flag_value(argv, "--hicache-size") == "120"
    assert "--hicache-ratio" not in argv
    assert flag_value(argv, "--speculative-algorithm") == "EAGLE3"
    assert flag_value(argv, "--speculative-draft-model-path") == "/models/Qwen3-235B-eagle3"
    assert flag_value(argv, "--speculative-num-steps") == "3"
    assert flag_value(argv, "--speculative-eagle-topk") == "1"
    assert flag_value(argv, "--speculative-num-draft-tokens") == "4"
    assert argv[-4:] == ["--log-level", "info", "--cuda-graph-max-bs", "128"]
    assert "--api-key" not in argv
    # Every token accounted for: 3 for the executable + each flag's (flag, value) or bare flag.
    assert len(argv) == 3 + 2 * 16 + 2 + 4

    emu = build_command(ServerConfig(**{**cfg.__dict__, "backend": "emulator"}), 0.875)
    assert emu[:3] == ["/opt/sglang/bin/python", "-m", "emulator"]
    assert emu[3:] == argv[3:]


def test_default_fraction_leaves_flag_out():
    argv = build_command(ServerConfig(model_path="m"), None)
    assert "--mem-fraction-static" not in argv
    assert argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "1",
                    "--host", "127.0.0.1", "--port", "30000"]
    assert flag_value(build_command(ServerConfig(model_path="m"), 0.9), "--mem-fraction-static") == "0.9"


def test_api_key_only_in_env_and_bootstrap():
    cfg = ServerConfig(model_path="m", api_key="sk-very-secret-123", backend="emulator")
    argv = launch_argv(cfg, 0.88)
    assert not any("sk-very-secret-123" in a for a in argv)
    assert argv[1] == "-c" and argv[3] == "emulator"
    assert argv[4:] == build_command(cfg, 0.88)[3:]
    env = launch_env(cfg, base={"PATH": "/bin", API_KEY_ENV: "stale"})
    assert env[API_KEY_ENV] == "sk-very-secret-123"
    assert API_KEY_ENV not in launch_env(ServerConfig(model_path="m"), base={API_KEY_ENV: "stale"})
    assert "sk-very-secret-123" not in repr(cfg)


def test_gpus_select_cuda_visible_devices():
    cfg = ServerConfig(model_path="m", tp_size=2, gpus=(4, 5))
    assert launch_env(cfg, base={})["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert cfg.gpu_indexes() == [4, 5]
    assert ServerConfig(model_path="m", tp_size=2).gpu_indexes() == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model_path": " "}, "model_path"),
        ({"tp_size": 0}, "tp_size"),
        ({"port": 70000}, "port"),
        ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
        ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
        ({"hicache_size": 10}, "enable_hierarchical_cache"),
        ({"enable_hierarchical_cache": True, "hicache_size": -1}, "hicache_size"),
        ({"enable_hierarchical_cache": True, "hicache_size": 2.5}, "hicache_size"),
        ({"enable_hierarchical_cache": True, "hicache_size": "8"}, "hicache_size"),
        ({"speculative_num_steps": 3}, "speculative_algorithm"),
        ({"speculative_algorithm": "EAGLE3"}, "speculative_draft_model_path"),
        ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm"),
        ({"extra_args": ("--api-key", "x")}, "--api-key"),
        ({"extra_args": ("--mem-fraction-static=0.8",)}, "--mem-fraction-static"),
        ({"tp_size": 2, "gpus": (0,)}, "gpus"),
        ({"gpus": (1, 1)}, "gpus"),
        ({"backend": "vllm"}, "backend"),
        ({"reasoning_parser": "qwen3; rm -rf /"}, "reasoning_parser"),
        ({"api_key": ""}, "api_key"),
        ({"context_length": 0}, "context_length"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(ServerConfigError, match=needle.replace("-", r"\-")):
        ServerConfig(**{"model_path": "m", **kwargs})


# --- classifier ------------------------------------------------------------------------------------

P = "[2026-01-01 10:00:00 TP0] "


@pytest.mark.parametrize(
    ("log", "status", "kind"),
    [
        (P + "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.", -9, "too_low"),
        (P + "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
         "Current value: mem_fraction_static=0.5", -9, "too_low"),
        (P + "Capture cuda graph failed: CUDA out of memory.\nPossible solutions: 1. set "
         "--mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)", -9, "too_high"),
        (P + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB", -9, "too_high"),
        (P + "Prefill out of memory. Try to lower your batch size.", -9, "kv_pool_exhausted"),
        (P + "Decode out of memory. Try to lower your batch size.", -9, "kv_pool_exhausted"),
        ("Not enough host memory available. Requesting 800 GB but only have 200 GB free.", 1, "host_memory"),
        ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
         "address already in use", 1, "port_in_use"),
        ("usage: launch_server.py [-h] ...\nlaunch_server.py: error: unrecognized arguments: --bogus", 2,
         "bad_flag"),
        ("usage: x\nx: error: argument --tp-size: invalid int value: 'a'", 2, "bad_flag"),
        ("something odd\n", 2, "bad_flag"),
        ("OSError: /nope is not a local folder and is not a valid model identifier", 1, "model_not_found"),
        ("huggingface_hub.errors.RepositoryNotFoundError: 404", 1, "model_not_found"),
        (P + "KV cache pool is full. Retract requests. #retracted_reqs: 3\nSegmentation fault", -11, "unknown"),
        ("", None, "unknown"),
        (P + "Load weight begin. avail mem=53.89 GB\n" + P + "torch.OutOfMemoryError: CUDA out of memory. "
         "Tried to allocate 56.00 GiB.", -9, "weights_too_big"),
        (P + "Load weight end. type=X, avail mem=9 GB, mem usage=50 GB.\n" + P +
         "torch.OutOfMemoryError: CUDA out of memory.", -9, "too_high"),
    ],
)
def test_classifier(log, status, kind):
    f = classify_failure(log, status)
    assert f.kind == kind
    assert f.explanation and "\n" not in f.explanation
    if kind in ("too_low", "too_high", "port_in_use", "host_memory", "model_not_found", "weights_too_big"):
        assert f.evidence and f.evidence in log


def test_classifier_explanations_say_what_to_do():
    assert "raise --mem-fraction-static" in classify_failure(
        "Not enough memory. Please try to increase --mem-fraction-static.", -9).explanation
    assert "lower --mem-fraction-static" in classify_failure("CUDA out of memory.", -9).explanation
    assert "unknown" in classify_failure("", None).explanation or "exit status" in classify_failure(
        "", None).explanation
    assert "exit status -11" in classify_failure("boom", -11).explanation


def test_effective_fraction():
    assert effective_fraction("server_args=ServerArgs(mem_fraction_static=0.871, tp_size=1)") == 0.871
    assert effective_fraction("... Current value: mem_fraction_static=0.5.") == 0.5
    assert effective_fraction("nothing") is None


# --- progress ---------------------------------------------------------------------------------------

OLD_LOG = """\
[2026-01-01 10:00:00 TP0] Load weight begin. avail mem=78.50 GB
[2026-01-01 10:00:00 TP1] Load weight begin. avail mem=78.50 GB
[2026-01-01 10:00:09 TP0] Load weight end. type=DeepseekV2ForCausalLM, dtype=torch.bfloat16, avail mem=11.20 GB, mem usage=67.30 GB.
[2026-01-01 10:00:09 TP1] Load weight end. type=DeepseekV2ForCausalLM, dtype=torch.bfloat16, avail mem=11.10 GB, mem usage=67.40 GB.
[2026-01-01 10:00:10 TP0] KV Cache is allocated. #tokens: 421000, K size: 2.95 GB, V size: 2.95 GB
[2026-01-01 10:00:10 TP0] Memory pool end. avail mem=5.90 GB
[2026-01-01 10:00:10 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=5.80 GB
[2026-01-01 10:00:51 TP0] Capture cuda graph end. Time elapsed: 41.37 s. mem usage=0.33 GB. avail mem=5.47 GB.
[2026-01-01 10:00:51 TP1] Capture cuda graph end. Time elapsed: 41.37 s. mem usage=0.33 GB. avail mem=5.41 GB.
[2026-01-01 10:00:52 TP0] max_total_num_tokens=421000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=2048, context_len=262144, available_gpu_mem=5.47 GB
INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
[2026-01-01 10:00:55] The server is fired up and ready to roll!
"""

NEW_LOG = """\
[2026-01-01 10:00:09 TP0] Load weight end. elapsed=8.1 s, type=Qwen3MoeForCausalLM, dtype=torch.bfloat16, avail mem=20.00 GB, mem usage=60.00 GB.
[2026-01-01 10:00:10 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 99000, KV size: 4.00 GB
[2026-01-01 10:00:10 TP0] Capture target decode CUDA graph begin. avail mem=1.20 GB
[2026-01-01 10:00:20 TP0] Capture target decode CUDA graph end. Time elapsed: 9.9 s. mem usage=0.40 GB. avail mem=0.80 GB.
"""


def test_progress_old_form_worst_rank():
    p = parse_progress(OLD_LOG)
    assert p.phase == "ready"
    assert p.weights_gib == 67.40
    assert p.avail_after_weights_gib == 11.10
    assert p.kv_tokens == 421000
    assert p.max_total_num_tokens == 421000
    assert p.headroom_gib == 5.41
    assert p.ranks_reported == 2


def test_progress_new_form_and_incremental():
    lines = NEW_LOG.splitlines(keepends=True)
    p = parse_progress("".join(lines[:2]))
    assert p.phase == "kv_cache" and p.kv_tokens == 99000 and p.headroom_gib is None
    parse_progress("".join(lines[2:3]), p)
    assert p.phase == "cuda_graph"
    parse_progress("".join(lines[3:]), p)
    assert p.headroom_gib == 0.80 and p.weights_gib == 60.0


# SGLang 0.5.23 on CPU, node 0 of `--tp-size 2 --nnodes 2` (2026-12-07): it waited 23 s at "Init parallel
# begin." until node 1 joined
NODE0_LOG = """\
[2026-12-07 16:44:50 TP0] Init parallel begin.
[2026-12-07 16:44:50 TP0] init_threads_binding: numa_index=0, world_size=2, local_omp_cpuid=0
[2026-12-07 16:45:13 TP0] Init parallel ends. elapsed=23.06 s
[2026-12-07 16:45:14 TP0] Load weight begin. avail mem=20.98 GB
"""


def test_progress_says_when_the_ranks_wait_to_join():
    lines = NODE0_LOG.splitlines(keepends=True)
    p = parse_progress("".join(lines[:3]))
    assert p.phase == "parallel_init"  # what a launch timed out in: a node that never joined
    parse_progress("".join(lines[3:]) + NEW_LOG, p)
    assert p.phase == "cuda_graph"


SPECULATIVE_EP_LOG = """\
[2026-12-01 10:00:10 TP0 EP0] Capture cuda graph begin. This can take up to several minutes. avail mem=9.00 GB
[2026-12-01 10:00:20 TP0 EP0] Capture cuda graph end. Time elapsed: 9.9 s. mem usage=0.40 GB. avail mem=8.60 GB.
[2026-12-01 10:00:20 TP1 EP1] Capture cuda graph end. Time elapsed: 9.9 s. mem usage=0.40 GB. avail mem=8.50 GB.
[2026-12-01 10:00:21 TP0 EP0] Capture draft decode CUDA graph begin. backend=fa3, avail mem=8.60 GB
[2026-12-01 10:00:25 TP0 EP0] Capture draft decode CUDA graph end. Time elapsed: 4.0 s. mem usage=0.20 GB. avail mem=8.40 GB.
[2026-12-01 10:00:25 TP1 EP1] Capture draft decode CUDA graph end. Time elapsed: 4.0 s. mem usage=0.20 GB. avail mem=8.30 GB.
[2026-12-01 10:00:26 TP0 EP0] Capture draft extend CUDA graph begin. backend=fa3, avail mem=8.40 GB
[2026-12-01 10:00:29 TP0 EP0] Capture draft extend CUDA graph end. Time elapsed: 3.0 s. mem usage=0.10 GB. avail mem=8.30 GB.
[2026-12-01 10:00:29 TP1 EP1] Capture draft extend CUDA graph end. Time elapsed: 3.0 s. mem usage=0.10 GB. avail mem=8.20 GB.
"""


def test_progress_reads_speculative_graphs_and_ep_rank_prefixes():
    lines = SPECULATIVE_EP_LOG.splitlines(keepends=True)
    p = parse_progress("".join(lines[3:4]))
    assert p.phase == "cuda_graph"
    p = parse_progress(SPECULATIVE_EP_LOG)
    assert p.phase == "cuda_graph" and p.headroom_gib == 8.20 and p.ranks_reported == 2


# SGLang 0.5.23's own forms (cuda_graph_setup.py, eagle_worker_v2.py, uno_worker_v2.py and the
# scheduler's logger prefix with data, tensor and expert parallel ranks).
SPECULATIVE_0523_LOG = """\
[2026-12-01 10:00:10 DP0 TP0 EP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=4, avail mem=9.10 GB
[2026-12-01 10:00:20 DP0 TP0 EP0] Capture target verify CUDA graph end. bs=[1, 2, 4, 8], elapsed=9.90 s, mem usage=0.40 GB, avail mem=8.80 GB.
[2026-12-01 10:00:20 DP0 TP3 EP3] Capture target verify CUDA graph end. bs=[1, 2, 4, 8], elapsed=9.90 s, mem usage=0.40 GB, avail mem=8.70 GB.
[2026-12-01 10:00:21 DP0 TP0 EP0] Capture draft decode CUDA graph begin. backend=fa3, num_tokens_per_req=1, bs=[1, 2], avail mem=8.80 GB
[2026-12-01 10:00:25 DP0 TP0 EP0] Capture draft decode CUDA graph end. elapsed=4.00 s, mem usage=0.20 GB, avail mem=8.60 GB.
[2026-12-01 10:00:26 DP0 TP0 EP0] Capture UNO tree draft CUDA graph end. elapsed=1.00 s, mem usage=0.10 GB, avail mem=8.50 GB.
[2026-12-01 10:00:27 DP0 TP0 EP0] Capture Frozen-KV MTP draft cuda graph end.
"""


def test_progress_reads_sglang_0523_speculative_graphs_with_dp_tp_ep_prefixes():
    p = parse_progress(SPECULATIVE_0523_LOG.splitlines()[0])
    assert p.phase == "cuda_graph"
    p = parse_progress(SPECULATIVE_0523_LOG)
    assert p.phase == "cuda_graph" and p.headroom_gib == 8.50 and p.ranks_reported == 2


@pytest.mark.parametrize("device", ["NPU", "XPU", "CPU"])
def test_progress_reads_graph_lines_of_other_devices(device):
    p = parse_progress(f"[2026-12-01 10:00:10 TP0] Capture target decode {device} graph begin. backend=full, "
                       "num_tokens_per_req=1, avail mem=30.00 GB\n"
                       f"[2026-12-01 10:00:12 TP0] Capture target decode {device} graph end. bs=[1], elapsed=2.00 s, "
                       "mem usage=1.00 GB, avail mem=29.00 GB.")
    assert p.phase == "cuda_graph" and p.headroom_gib == 29.0


# Real SGLang 0.5.23 on CPU (tests/sglang's tiny model): host memory is no GPU headroom.
CPU_LOG = """\
[2026-12-01 07:18:58] Load weight begin. avail mem=21.76 GB
[2026-12-01 07:18:58] Load weight end. elapsed=0.02 s, type=Qwen3ForCausalLM, avail mem=21.76 GB, mem usage=-0.00 GB.
[2026-12-01 07:18:58] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096, K size: 0.00 GB, V size: 0.00 GB
[2026-12-01 07:18:58] Memory pool end. avail mem=21.74 GB
[2026-12-01 07:18:58] max_total_num_tokens=4096, chunked_prefill_size=4096, max_prefill_tokens=16384, max_running_requests=2048, context_len=2048, available_cpu_mem=21.74 GB
[2026-12-01 07:18:59] INFO:     Uvicorn running on http://127.0.0.1:31877 (Press CTRL+C to quit)
"""


def test_progress_reads_the_cpu_log_of_real_sglang():
    p = parse_progress(CPU_LOG)
    assert p.max_total_num_tokens == 4096 and p.kv_tokens == 4096
    assert p.weights_gib == 0.0 and p.avail_after_weights_gib == 21.76
    assert p.headroom_gib is None
    assert p.phase == "http_up"


def test_progress_without_graphs_uses_available_gpu_mem():
    p = parse_progress("max_total_num_tokens=1000, chunked_prefill_size=8192, available_gpu_mem=3.25 GB")
    assert p.headroom_gib == 3.25


def test_launch_failed_message_names_everything():
    exc = LaunchFailed(Failure("too_low", "raise it", "Not enough memory."), "a\nb\nNot enough memory.",
                       exit_status=-9, log_path="/tmp/x.log", command=["python", "-m", "emulator"], fraction=0.5)
    text = str(exc)
    for part in ("too_low", "0.5", "raise it", "exit status: -9", "/tmp/x.log", "python -m emulator",
                 "    Not enough memory."):
        assert part in text


def test_every_public_name_is_importable_from_tasks_server():
    for mod in (config, server_log):
        missing = [n for n in mod.__all__ if n not in server.__all__ and not n.startswith(("explanation", "log_"))]
        assert not missing, f"{mod.__name__} names not re-exported by tasks.server: {missing}"
    assert all(hasattr(server, n) for n in server.__all__)
    assert server.LaunchFailed is server_log.LaunchFailed and server.ServerConfig is config.ServerConfig
    assert issubclass(server.LaunchFailed, server.ServerError)


def test_log_file_names_differ_per_fraction_and_name_the_port():
    cfg = ServerConfig(model_path="m", port=31234)
    a, b = log_file_name(cfg, 0.8), log_file_name(cfg, None)
    assert a.startswith("server-31234-") and a.endswith("-f0.8.log") and b.endswith("-fdefault.log")
