"""What the Prefect UI shows of a run, without a server: the flow's parameter schema (the custom-run
form), run names, the log filter, the progress text, the ETA estimators and the run summary."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
from prefect.exceptions import ParameterTypeError
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate

from flows import logs
from flows.datagen import datagen, flow_run_name
from flows.eta import EtaInputs, row_rate, steady_rate
from flows.params import PARAMETER_HELP, form_schema
from flows.progress import Progress
from flows.summary import RunSummary
from tasks.artifacts import gpu_label
from tasks.inference import ServerGone, ShardProgress
from tasks.reasoning import PARSERS
from tasks.validation import ValidationFailed


def test_every_flow_parameter_has_a_type_a_default_and_a_description_and_choices_or_bounds() -> None:
    props = parameter_schema(datagen).model_dump()["properties"]
    assert list(props) == list(PARAMETER_HELP)  # one description per parameter, in order
    for name, p in props.items():
        assert p["description"] == PARAMETER_HELP[name], name
        assert "default" in p and ("type" in p or "anyOf" in p), name

    def variant(name: str) -> dict[str, Any]:
        return next(v for v in props[name]["anyOf"] if v.get("type") != "null")

    assert variant("backend")["enum"] == ["sglang", "emulator"]
    assert variant("reasoning_parser")["enum"] == sorted(PARSERS)
    assert (variant("mem_fraction_static")["exclusiveMinimum"], variant("mem_fraction_static")["exclusiveMaximum"]) == (0, 1)
    assert variant("shard_size")["minimum"] == 1 and variant("concurrency")["minimum"] == 1
    assert props["partition"] == {**props["partition"], "type": "string", "default": "all"}


def test_the_form_schema_shows_each_optional_parameter_by_its_type_and_the_server_still_validates() -> None:
    raw = parameter_schema(datagen).model_dump()
    form = form_schema(raw)
    props = form["properties"]
    assert raw["properties"]["shard_size"]["anyOf"][1] == {"type": "null"}  # the input is left as it was
    assert list(props) == list(PARAMETER_HELP)
    for name, p in props.items():
        assert p["description"] == PARAMETER_HELP[name] and p["title"] == name, name
        assert {"type": "null"} not in p.get("anyOf", []), name  # no "Property is type None" branch
    assert props["partition"] == raw["properties"]["partition"]  # a real default stays
    assert props["shard_size"] == {"type": "integer", "minimum": 1, "maximum": 1_000_000, "title": "shard_size", "position": 6,
                                   "description": PARAMETER_HELP["shard_size"]}
    assert props["backend"]["enum"] == ["sglang", "emulator"] and "default" not in props["backend"]
    assert props["reasoning_parser"]["enum"] == sorted(PARSERS)
    assert (props["mem_fraction_static"]["exclusiveMinimum"], props["mem_fraction_static"]["exclusiveMaximum"]) == (0, 1)
    assert props["inputs"]["type"] == "array" and props["inputs"]["items"] == {"type": "string"}
    assert [b["type"] for b in props["server_url"]["anyOf"]] == ["string", "array"]
    assert form_schema(form) == form
    # What the API server checks when a run is created from the deployment (ignore_required, as it does).
    for ok in ({}, {"shard_size": 5, "backend": "emulator"}, {"shard_size": None}, {"server_url": ["http://h:1"]}):
        validate(ok, form, raise_on_error=True, ignore_required=True)
    for bad, field in (({"shard_size": 0}, "shard_size"), ({"samples": 10**9}, "samples"), ({"backend": "vllm"}, "backend"),
                       ({"mem_fraction_static": 1.0}, "mem_fraction_static")):
        with pytest.raises(ValidationError, match=field):
            validate(bad, form, raise_on_error=True, ignore_required=True)


def test_out_of_bounds_and_unknown_choices_are_refused_before_the_run() -> None:
    with pytest.raises(ParameterTypeError, match="mem_fraction_static"):
        datagen.validate_parameters({"mem_fraction_static": 1.5})
    with pytest.raises(ParameterTypeError, match="reasoning_parser"):
        datagen.validate_parameters({"reasoning_parser": "qwen4"})
    assert datagen.validate_parameters({"backend": "emulator", "shard_size": 5})["shard_size"] == 5


def test_flow_run_name_is_partition_and_scheduled_date(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.runtime import flow_run

    when = datetime(2026, 3, 4, 2, 0, tzinfo=UTC)
    monkeypatch.setitem(flow_run.FIELDS, "parameters", lambda: {"partition": "/x/nightly.toml"})
    monkeypatch.setitem(flow_run.FIELDS, "scheduled_start_time", lambda: when)
    assert flow_run_name() == "nightly-2026-03-04-0200"
    monkeypatch.setitem(flow_run.FIELDS, "name", lambda: "mustard-seal")  # Prefect's made-up name
    assert flow_run_name() == "nightly-2026-03-04-0200"
    monkeypatch.setitem(flow_run.FIELDS, "name", lambda: "my-parser-experiment")  # a person's
    assert flow_run_name() == "my-parser-experiment"


def test_generated_run_names_carry_the_output_and_a_person_s_name_is_kept() -> None:
    from prefect.utilities.names import generate_slug

    from flows.names import is_generated, run_name

    assert all(is_generated(generate_slug(2)) for _ in range(500))
    assert not any(is_generated(n) for n in ("my-parser-experiment", "parser-test", "nightly", "qwen3-run2"))
    when = datetime(2026, 12, 2, 2, 59, tzinfo=UTC)
    assert run_name("calm-otter", {"partition": "demo"}, when) == "demo-2026-12-02-0259"
    assert run_name("calm-otter", {"partition": "demo", "out": "/data/x/parser-b"}, when) == \
        "demo-parser-b-2026-12-02-0259"
    assert run_name("calm-otter", {"out": "/o/a b"}, when) == "all-a-b-2026-12-02-0259"
    assert run_name("calm-otter", {"partition": "demo", "out": "data/out/demo"}, when) == "demo-2026-12-02-0259"
    assert run_name("my-parser-experiment", {"partition": "demo"}, when) == "my-parser-experiment"


def test_gpu_labels() -> None:
    assert [gpu_label(g) for g in ([0], [0, 1], list(range(8)), [1, 3])] == ["gpu0", "gpu0,1", "gpu0..7", "gpu1,3"]


def _record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, exc_info)


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - a traceback to strip
        return e


def test_log_filter_drops_completed_lines_and_tells_an_expected_failure_once_without_traceback() -> None:
    f = logs.RunLogFilter()
    assert not f.filter(_record("prefect.task_runs", "Finished in state Completed()"))
    assert f.filter(_record("prefect.flow_runs", "Finished in state Completed()"))  # the run's own line stays
    gone = _raised(ValidationFailed("shard 0 failed", None))
    assert not f.filter(_record("prefect.task_runs", "Task run failed with exception: x - Retries are exhausted", gone))
    assert not f.filter(_record("prefect.task_runs", "Finished in state Failed('Task run encountered an exception "
                                                     "ValidationFailed: shard 0 failed')"))
    flow_line = _record("prefect.flow_runs", "Encountered exception during execution: %r", gone)
    assert f.filter(flow_line) and flow_line.getMessage() == "ValidationFailed: shard 0 failed"
    assert flow_line.exc_info is None
    final = _record("prefect.flow_runs", "Finished in state Failed('Flow run encountered an exception: "
                                         "ServerGone: long text')")
    assert f.filter(final) and final.getMessage() == "Finished in state Failed: ServerGone (above)"
    assert not f.filter(_record("prefect.flow_runs", "Engine execution exited with unexpected exception", gone))
    bug = _raised(KeyError("x"))
    assert f.filter(r := _record("prefect.task_runs", "Task run failed with exception: KeyError", bug))
    assert r.exc_info is not None  # a bug keeps its traceback
    assert f.filter(_record("prefect.flow_runs", "Engine execution exited with unexpected exception", bug))
    assert issubclass(ServerGone, Exception) and "ServerGone" in logs._error_names()


def test_log_filter_tells_a_cancelled_run_as_cancelled_and_a_plain_sigterm_as_the_crash_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    f = logs.RunLogFilter()
    crash = "Crash detected! Execution was aborted by a termination signal."
    finished = "Finished in state Crashed('Execution was aborted by a termination signal.')"
    for announced in (False, True):
        monkeypatch.setattr(logs, "cancel_announced", lambda announced=announced: announced)
        r = _record("prefect.task_runs", crash)
        assert f.filter(r)
        assert (r.getMessage(), r.levelno) == (("stopped: the flow run was cancelled", logging.INFO) if announced
                                               else (crash, logging.ERROR))
        assert f.filter(_record("prefect.task_runs", finished)) is not announced
        r = _record("prefect.flow_runs", "Finished in state Running()")
        assert f.filter(r) and r.getMessage() == ("Finished: cancelled (the worker records the Cancelled state)"
                                                  if announced else "Finished in state Running()")


def test_progress_and_summary_of_a_cancelled_run_say_cancelled_what_is_kept_and_how_to_resume() -> None:
    p = Progress(partition="demo", datasets={"a": 300}, shard_size=100, concurrency=8, logger=logging.getLogger("t"))
    p.start({})
    p.shard_committed(_shard("a", 0, 100))
    p.close("cancelled", "interrupted (Ctrl-C)")
    assert p.describe().startswith("demo: CANCELLED (interrupted (Ctrl-C)) after ")
    assert "1/3 shards, 100/300 rows (a 100/300) kept" in p.describe() and "FAILED" not in p.describe()
    s = _summary(verdict="CANCELLED", reason="interrupted (Ctrl-C); 1 of 3 shards were committed and are kept")
    assert s.headline().startswith("CANCELLED: demo: 600 rows -> /o")
    assert s.headline().endswith("; interrupted (Ctrl-C); 1 of 3 shards were committed and are kept")
    assert s.markdown().startswith("# Run summary: CANCELLED")


def _shard(dataset: str, shard: int, rows: int, *, tokens: int = 1000, latency: float = 0.5) -> ShardProgress:
    return ShardProgress(dataset=dataset, shard=shard, rows=rows, rows_generated=rows, rejects=0, prompt_tokens=tokens,
                         completion_tokens=2 * tokens, elapsed_s=1.0, tokens_per_s=1.0, retries=0, shards_committed=1,
                         shards_total=None, dataset_rows_done=rows, dataset_rows_total=None, eta_s=None,
                         latencies_s=(latency,) * rows)


def test_progress_tells_rates_datasets_tokens_and_its_end_state(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0] + [float(t) for t in range(1, 100)])
    monkeypatch.setattr("flows.progress.time.monotonic", lambda: next(clock))
    p = Progress(partition="demo", datasets={"a": 200, "b": 100}, shard_size=100, concurrency=8,
                 logger=logging.getLogger("test"))
    p.start({"a": (1, 100, 0)})  # resumed: counted as done, not in the rates
    p.shard_committed(_shard("a", 1, 100))
    text = p.describe()
    assert text.startswith("demo: 2/3 shards, 200/300 rows (a 200/200, b 0/100)")
    assert "rows/s" in text and "tokens 1000 in / 2000 out" in text and "ETA " in text
    p.shard_committed(_shard("b", 0, 100))
    assert "all shards committed" in p.describe() and "ETA" not in p.describe()
    p.close("done")
    assert p.describe().startswith("demo: DONE in ") and "ETA" not in p.describe()
    q = Progress(partition="demo", datasets={"a": 200}, shard_size=100, concurrency=8, logger=logging.getLogger("t"))
    q.start({})
    q.shard_committed(_shard("a", 0, 100))
    q.close("failed", "ValidationFailed")
    assert q.describe().startswith("demo: FAILED (ValidationFailed) after ") and "1/2 shards, 100/200 rows" in q.describe()


def test_progress_counts_rows_per_sample_against_prompts_times_samples() -> None:
    # 20 prompts, 2 samples each, shards of 10 prompts: a shard holds 20 rows
    p = Progress(partition="demo", datasets={"a": 20}, shard_size=10, concurrency=8, logger=logging.getLogger("t"),
                 samples=2)
    p.start({})
    p.shard_committed(_shard("a", 0, 20))
    assert p.describe().startswith("demo: 1/2 shards, 20/40 rows (a 20/40)") and "ETA " in p.describe()
    p.shard_committed(_shard("a", 1, 20))
    p.close("done")
    assert "2/2 shards, 40/40 rows (a 40/40)" in p.describe()


def test_steady_rate_leaves_out_the_pipeline_fill_before_the_first_commit() -> None:
    # 100 rows at 10 s (filling the pipeline), then 100 rows every 2 s: 400 rows left take 8 s.
    x = EtaInputs(elapsed_s=14.0, rows_new=400, shards_new=4, rows_left=400, shards_left=4, datasets_left=1,
                  first_s=10.0, first_rows=100)
    assert steady_rate(x, [], 8) == pytest.approx(4.0 * 400 / 300)
    assert row_rate(x, [], 8) == pytest.approx(14.0)


def _line_rate_and_eta(text: str) -> tuple[float, int]:
    import re
    rate = float(re.search(r", ([\d.,]+) rows/s,", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    m, s = re.search(r"ETA (\d+)m(\d+)s", text).groups()  # type: ignore[union-attr]
    return rate, int(m) * 60 + int(s)


@pytest.mark.parametrize("commits", [
    [(60.0, 100), (60.5, 100)],  # issue 25: two shards committed close together after a 60 s fill
    [(30.0, 100), (30.1, 100), (30.2, 100), (31.0, 100)],
    [(10.0, 100), (20.0, 100), (30.0, 100), (40.0, 100)],  # steady: one shard every 10 s
])
def test_the_progress_line_s_rate_and_its_eta_agree_when_shards_commit_in_bursts(
        monkeypatch: pytest.MonkeyPatch, commits: list[tuple[float, int]]) -> None:
    now = {"t": 0.0}
    monkeypatch.setattr("flows.progress.time.monotonic", lambda: now["t"])
    p = Progress(partition="demo", datasets={"a": 600}, shard_size=100, concurrency=32, logger=logging.getLogger("t"))
    p.started = 0.0
    p.start({})
    done = 0
    for i, (t, rows) in enumerate(commits):
        now["t"] = t
        p.shard_committed(_shard("a", i, rows))
        done += rows
        rate, eta = _line_rate_and_eta(p.describe())
        left = 600 - done
        # the line shows the rate to 0.1 rows/s and the ETA to the second
        assert left / (rate + 0.05) - 1 <= eta <= left / (rate - 0.05) + 1, p.describe()
        assert eta >= 0.5 * left / (done / t), p.describe()  # never half the time the average rate needs
    if commits[0][0] == 60.0:
        assert "ETA 0m00s" not in p.describe() and "ETA 0m0" not in p.describe()


def _summary(**kw: Any) -> RunSummary:
    base: dict[str, Any] = dict(partition="demo", verdict="PASS", out_dir="/o", latest="/l", rows={"a": 400, "b": 200},
                                rows_new=600, prompt_tokens=1000, completion_tokens=5000, wall_s=120.0, gpus=2,
                                gpu_hours=2 * 120 / 3600, relaunches=1, max_relaunches=3)
    return RunSummary(**{**base, **kw})


def test_run_summary_costs_per_thousand_rows_only_with_a_price() -> None:
    s = _summary(price_per_gpu_hour=3.0)
    assert s.cost == pytest.approx(0.2) and s.cost_per_1k_rows == pytest.approx(0.2 / 0.6)
    assert s.headline() == "PASS: demo: 600 rows -> /o, latest -> /l, 2m00s, 1 relaunch"
    md = s.markdown()
    for part in ("| rows | 600 (a 400, b 200) |", "| tokens in / out | 1,000 / 5,000 |", "5.00 rows/s",
                 "| GPU-hours | 0.067 (2 GPU(s)) |", "| relaunches | 1 of 3 |", "| cost per 1,000 rows | 0.3333 |"):
        assert part in md, part
    assert _summary().cost_per_1k_rows is None and "cost" not in _summary().markdown()
    assert "shared server" in _summary(gpu_hours=None).markdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
