"""Real SGLang failure logs (tests/data/sglang_failures) classified as a careful engineer would.

The file format is tests/support/failure_corpus.py's. Add a file whenever a new failure is met; logs
the classifier was not tuned on go in heldout/ (test_failure_heldout.py) until a fix is tuned on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.server import (
    Attempt,
    Failure,
    FileStore,
    FractionMemory,
    LaunchFailed,
    ServerConfig,
    TuningPolicy,
    classify_failure,
    effective_fraction,
    launch,
    launch_tuned,
    next_fraction,
    record_runtime_oom,
    runtime_failure,
)
from tasks.server._log import log_tail
from tests.support.common import free_port
from tests.support.failure_corpus import CORPUS, MOVES_FRACTION, classify_log, fraction_moves, read_log

FILES = sorted(CORPUS.glob("*.log"))


def test_corpus_has_real_runs_and_issue_excerpts() -> None:
    sources = [read_log(f)[0].get("source", "") for f in FILES]
    assert len(FILES) >= 15
    assert all(sources)
    assert sum(s.startswith("real run here") for s in sources) >= 4
    assert sum(s.startswith("https://github.com/") for s in sources) >= 10


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_classified_as_expected(path: Path) -> None:
    header, text, failure = classify_log(path)
    assert failure.kind == header["expect"], failure
    if failure.kind in MOVES_FRACTION:
        assert failure.evidence and failure.evidence in text
    expected_suggestion = float(header["suggested"]) if "suggested" in header else None
    assert failure.suggested_fraction == expected_suggestion


# SGLang 0.5.23's messages for pools that leave no room (its source, values filled in): no real log yet.
SOURCE_MESSAGES = [
    ("RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
     "max_mamba_cache_size=0, mamba_ratio=2, resulting max_num_reqs=0. Try: (1) reduce --max-running-requests, "
     "(2) increase --mem-fraction-static, or (3) use GPUs with more memory.", "too_low"),
    ("RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. Computed "
     "max_mamba_cache_size=0 (total_rest_memory=0.50 GB, mamba_cache_per_req=64.00 MB). Try: (1) reduce "
     "--max-running-requests, (2) increase --mem-fraction-static, (3) reduce --speculative-num-draft-tokens, "
     "or (4) use GPUs with more memory.", "too_low"),
    ("RuntimeError: SWA pool cap (65536 tokens, 3.00 GiB) leaves no room for the full KV pool within the "
     "available 2.50 GiB. Reduce --max-running-requests, lower SGLANG_SWA_EVICTION_INTERVAL, or increase "
     "--mem-fraction-static.", "too_low"),
    ("[2026-01-01 10:00:00 TP0] Prefill out of memory. Try to lower your batch size.\nTry to allocate 8192 "
     "tokens.\nAvailable tokens: 1024 (available_size=1024 + evictable_size=0)", "kv_pool_exhausted"),
    ("RuntimeError: Rank 3 scheduler died during initialization (exit code: -9). If exit code is -9 (SIGKILL), "
     "a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.", "host_memory"),
]


@pytest.mark.parametrize(("text", "kind"), SOURCE_MESSAGES, ids=[k for _, k in SOURCE_MESSAGES])
def test_source_message_variants(text: str, kind: str) -> None:
    assert classify_failure(text, 1).kind == kind


def test_kv_pool_exhaustion_advice_never_lowers_the_fraction() -> None:
    advice = classify_failure("Decode out of memory. Try to lower your batch size.", -9).explanation
    assert "raise --mem-fraction-static" in advice and "never lower it" in advice


def test_kv_pool_exhaustion_at_startup_stops_the_tuner_without_a_contradiction(tmp_path: Path) -> None:
    failure = classify_failure("Prefill out of memory. Try to lower your batch size.", -9)
    assert runtime_failure("Prefill out of memory. Try to lower your batch size.") is None

    def launcher(cfg, target, fraction, log_dir, deadline_s):  # type: ignore[no-untyped-def]
        raise LaunchFailed(failure, "", exit_status=-9, fraction=fraction)

    with pytest.raises(LaunchFailed) as info:
        launch_tuned(ServerConfig(model_path="/m", mem_fraction_static=0.8), "local", tmp_path,
                     memory=FractionMemory(FileStore(tmp_path / "f.json")), gpu_name="gpu", hygiene=None,
                     launcher=launcher)
    assert [a.fraction for a in info.value.attempts] == [0.8]
    assert "not fixed by changing" not in str(info.value) and "never lower it" in str(info.value)


# --- what the tuner does with these kinds ------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_failures_not_about_memory_never_move_the_fraction(path: Path) -> None:
    _, text, failure = classify_log(path)
    if failure.kind in MOVES_FRACTION:
        return
    # Neither the tuner nor a running server's log (runtime OOM recorded) moves the fraction.
    assert fraction_moves(text, failure) == []


def test_tuner_goes_above_the_fraction_sglang_suggests() -> None:
    failure = classify_failure("ValueError: Loaded weights leave no GPU memory for the KV cache under "
                               "--mem-fraction-static=0.8. Raise --mem-fraction-static above 0.912 "
                               "(minimum viable = 1 - available/pre = 0.9115).", -9)
    assert failure.suggested_fraction == 0.912
    nxt = next_fraction([Attempt(0.8, 0.8, failure, None, 1.0)], TuningPolicy())
    assert nxt is not None and nxt > 0.912
    assert nxt == 0.922


def test_a_suggestion_above_the_tuner_bounds_ends_the_search() -> None:
    failure = classify_failure("ValueError: Loaded weights leave no GPU memory for the KV cache under "
                               "--mem-fraction-static=0.9. Raise --mem-fraction-static above 0.96", -9)
    assert next_fraction([Attempt(0.9, 0.9, failure, None, 1.0)], TuningPolicy()) is None
    clamped = next_fraction([Attempt(0.9, 0.9, failure, None, 1.0)], TuningPolicy(bounds=(0.5, 0.99)))
    assert clamped == 0.97


LONG_DEFAULT_LOG = (
    "[2026-12-01 05:00:03] server_args={'model_path': '/m', 'mem_fraction_static': 0.716, 'tp_size': 1}\n"
    + "".join(f"[2026-12-01 05:00:04] line {i}\n" for i in range(60))
    + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")


def test_failed_default_launch_steps_down_from_the_fraction_sglang_used(tmp_path: Path) -> None:
    log = LONG_DEFAULT_LOG
    tried: list[float | None] = []

    def launcher(cfg, target, fraction, log_dir, deadline_s):  # type: ignore[no-untyped-def]
        tried.append(fraction)
        if len(tried) == 1:  # as tasks.server.launch raises it: the whole log's fraction, the tail
            raise LaunchFailed(classify_failure(log, -9), log_tail(log), exit_status=-9, fraction=fraction,
                               effective=effective_fraction(log))
        raise LaunchFailed(Failure("bad_flag", "stop here"), "", exit_status=2, fraction=fraction)

    with pytest.raises(LaunchFailed):
        launch_tuned(ServerConfig(model_path="/m"), "local", tmp_path, memory=FractionMemory(
            FileStore(tmp_path / "f.json")), gpu_name="gpu", hygiene=None, launcher=launcher)
    assert tried[0] is None
    assert tried[1] is not None and tried[1] < 0.716


def test_launch_reads_the_default_fraction_from_the_top_of_a_long_log(tmp_path: Path) -> None:
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(f"import os\nprint({LONG_DEFAULT_LOG!r}, end='', flush=True)\n"
                                          "os._exit(1)\n")
    cfg = ServerConfig(model_path="/m", port=free_port(), env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(LaunchFailed) as info:
        launch(cfg, "local", None, tmp_path / "logs", deadline_s=30)
    assert "server_args" not in info.value.log_tail
    assert (info.value.failure.kind, info.value.effective) == ("too_high", 0.716)


def test_failed_default_launch_with_no_fraction_in_its_log_never_guesses(tmp_path: Path) -> None:
    def launcher(cfg, target, fraction, log_dir, deadline_s):  # type: ignore[no-untyped-def]
        raise LaunchFailed(classify_failure("torch.OutOfMemoryError: CUDA out of memory.", -9), "",
                           exit_status=-9, fraction=fraction)

    with pytest.raises(LaunchFailed, match="set \\[server\\] mem_fraction_static") as info:
        launch_tuned(ServerConfig(model_path="/m"), "local", tmp_path, memory=FractionMemory(
            FileStore(tmp_path / "f.json")), gpu_name="gpu", hygiene=None, launcher=launcher)
    assert [a.fraction for a in info.value.attempts] == [None]


def test_runtime_oom_at_the_default_fraction_is_recorded(tmp_path: Path) -> None:
    memory = FractionMemory(FileStore(tmp_path / "f.json"))
    cfg = ServerConfig(model_path="/m")
    entry = record_runtime_oom(cfg, "local", None, log_text=LONG_DEFAULT_LOG, memory=memory, gpu_name="gpu")
    assert entry is not None and entry.runtime_oom_at == 0.716
    assert record_runtime_oom(cfg, "local", None, log_text="no fraction here", memory=memory,
                              gpu_name="gpu") is None


def test_effective_fraction_reads_the_forms_sglang_0_5_23_prints() -> None:
    said = FILES[0].parent / "real_cpu_weights_leave_no_kv.log"
    assert effective_fraction(read_log(said)[1]) == 1e-06
    assert effective_fraction("server_args={'model_path': '/m', 'mem_fraction_static': 0.716, 'tp_size': 1}") == 0.716


def test_a_sigkill_is_host_memory_only_when_a_dead_scheduler_is_named() -> None:
    assert classify_failure("[12-16 14:27:10] Exit code: -9", None).kind == "unknown"
    named = "[12-16 14:27:08] Rank 0 scheduler is dead. Please check if there are relevant logs.\n" \
            "[12-16 14:27:10] Exit code: -9"
    assert classify_failure(named, 1).kind == "host_memory"


def test_a_gated_model_is_permanent_and_names_the_token() -> None:
    failure = classify_failure("Cannot access gated repo for url https://huggingface.co/m/resolve/main/config.json.", 1)
    assert failure.kind == "model_not_found" and "HF_TOKEN" in failure.explanation
    assert not LaunchFailed(failure, "").retryable
