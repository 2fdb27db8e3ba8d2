"""GPU hygiene on the local target with real processes holding simulated GPU memory."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from datagen.cmd_clean_gpus import main as clean_main
from tasks.hygiene import HygieneReport, ProcessFinding, clean_gpus
from tasks.targets import start_detached
from tests.support.hygiene import Holder, alive, start_holder, stop_holders

NOBODY = 65534


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Append holders here; all their processes are SIGKILLed and reaped after the test."""
    started: list[Holder] = []
    yield started
    stop_holders(started)


def _by_pid(report: HygieneReport) -> dict[int, ProcessFinding]:
    return {p.pid: p for p in report.processes}


def test_holders_with_children_and_sigterm_ignorers_are_ended(sim_gpus, holders):
    polite = start_holder((0,), 4096, children=2, child_gpu=0, child_mib=2048)
    stubborn = start_holder((1,), 8192, ignore_term=True, children=1, child_gpu=1)
    holders += [polite, stubborn]
    t0 = time.monotonic()
    report = clean_gpus(gpus=[0, 1], grace_s=0.5, deadline_s=5)
    assert time.monotonic() - t0 < 4
    assert report.verdict == "clean" and report.clean
    procs = _by_pid(report)
    for pid in polite.all_pids:
        assert procs[pid].action == "kill" and procs[pid].ended_by == "SIGTERM", procs[pid]
        assert not alive(pid)
    for pid in stubborn.all_pids:
        assert procs[pid].ended_by == "SIGKILL" and not procs[pid].survived
        assert not alive(pid)
    assert procs[polite.pid].gpus == [0] and procs[polite.pid].mib == 4096
    assert "holds selected GPU(s) 0" in procs[polite.pid].reason
    gpus = {g.index: g for g in report.gpus}
    assert (gpus[0].before_mib, gpus[0].after_mib) == (4096 + 2 * 2048, 0)
    assert (gpus[1].before_mib, gpus[1].after_mib) == (8192 + 512, 0)
    assert report.survivors == []
    json.dumps(report.to_dict())  # JSON-serialisable as is


def test_unselected_gpu_holder_bystander_and_other_user_are_spared(sim_gpus, holders, reap_pids):
    target = start_holder((0,), 2048)
    elsewhere = start_holder((3,), 2048)
    holders += [target, elsewhere]
    bystander = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    other = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, user=NOBODY)
    reap_pids += [bystander.pid, other.pid]
    try:
        sim_gpus.set_allocation(0, 3000, pid=other.pid)
        report = clean_gpus(gpus="0", grace_s=1, deadline_s=0.5)
        procs = _by_pid(report)
        assert not alive(target.pid) and procs[target.pid].ended_by == "SIGTERM"
        assert alive(elsewhere.pid) and procs[elsewhere.pid].action == "spare"
        assert procs[elsewhere.pid].reason == "holds only unselected GPU(s) 3"
        assert alive(bystander.pid) and bystander.pid not in procs
        assert alive(other.pid)
        assert procs[other.pid].action == "spare" and procs[other.pid].user == "nobody"
        assert "another user (nobody)" in procs[other.pid].reason
        # The spared process still holds 3000 MiB: the GPU cannot be verified clean.
        assert report.verdict == "not_clean"
        assert report.gpus[0].after_mib == 3000
        assert "still above 1024 MiB" in report.summary()

        report = clean_gpus(gpus=[0], grace_s=1, deadline_s=5, include_other_users=True)
        assert report.clean and not alive(other.pid)
        assert _by_pid(report)[other.pid].ended_by == "SIGTERM"
    finally:
        for p in (bystander, other):
            p.kill()
            p.wait()


def test_holder_of_two_gpus_one_selected_is_killed_and_pure_elsewhere_holder_spared(sim_gpus, holders):
    both = start_holder((1, 2), 1024)
    only2 = start_holder((2,), 4096)
    holders += [both, only2]
    report = clean_gpus(gpus=[1], grace_s=1, deadline_s=5)
    procs = _by_pid(report)
    assert report.clean and procs[both.pid].gpus == [1, 2] and not alive(both.pid)
    assert alive(only2.pid) and procs[only2.pid].action == "spare" and procs[only2.pid].gpus == [2]


def test_orphan_reparented_away_is_found_by_its_memory(sim_gpus, holders):
    h = start_holder((), orphan_gpu=4, mib=5000)
    holders.append(h)
    assert h.orphan is not None
    with open(f"/proc/{h.orphan}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    assert ppid not in (h.pid, os.getpid())  # reparented (to PID 1 or a subreaper)
    report = clean_gpus(gpus=[4], grace_s=1, deadline_s=5)
    assert report.clean, report.summary()
    assert _by_pid(report)[h.orphan].ended_by == "SIGTERM"
    assert not alive(h.orphan) and alive(h.pid)


def test_late_release_is_awaited_by_polling(sim_gpus, holders):
    sim_gpus.set_release_delay(1.0)
    h = start_holder((5,), 6000, ignore_term=True)
    holders.append(h)
    report = clean_gpus(gpus=[5], grace_s=0.2, deadline_s=5)
    assert report.clean
    assert 0.8 <= report.waited_s < 3.0
    assert report.gpus[0].before_mib == 6000 and report.gpus[0].after_mib == 0

    # A deadline shorter than the driver's release lag: not clean, and the report says so.
    sim_gpus.set_release_delay(3.0)
    h2 = start_holder((5,), 6000)
    holders.append(h2)
    report = clean_gpus(gpus=[5], grace_s=0.2, deadline_s=0.3)
    assert report.verdict == "not_clean" and report.gpus[0].after_mib == 6000
    assert not alive(h2.pid) and report.survivors == []


def test_never_self_ancestors_or_pid1(sim_gpus):
    sim_gpus.set_allocation(0, 100, pid=os.getpid())
    sim_gpus.set_allocation(0, 100, pid=os.getppid())
    sim_gpus.set_allocation(0, 100, pid=1)
    report = clean_gpus(gpus=[0], grace_s=0.2, deadline_s=0.2)
    procs = _by_pid(report)
    assert procs[os.getpid()].action == "spare"
    assert procs[os.getpid()].reason == "the hygiene process or one of its ancestors"
    assert procs[os.getppid()].action == "spare"
    assert procs[1].action == "spare" and procs[1].reason in ("PID 1", "the hygiene process or one of its ancestors")
    assert report.killed == []
    assert report.clean  # 300 MiB is under the 1024 MiB threshold


def test_server_process_group_is_ended_even_without_gpu(sim_gpus, tmp_path, holders):
    bystander = start_holder((), 0)
    holders.append(bystander)
    pid = start_detached("local", ["sh", "-c", "sleep 300 & sleep 300 & wait"], str(tmp_path / "srv.log"))
    deadline = time.monotonic() + 10
    while len(_group(pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    members = _group(pid)
    assert len(members) == 3
    report = clean_gpus(gpus=[0], grace_s=1, deadline_s=1, extra_pids=[pid])
    procs = _by_pid(report)
    for m in members:
        assert procs[m].action == "kill" and not alive(m)
    assert "process group" in procs[pid].reason
    assert alive(bystander.pid)
    assert report.clean


def _group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def test_dry_run_kills_nothing(sim_gpus, holders, capsys):
    h = start_holder((0,), 2048)
    holders.append(h)
    assert clean_main(["--gpus", "0", "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "(dry run)" in out and f"kill  pid {h.pid}" in out
    assert alive(h.pid)


def test_cli_json_and_exit_codes(sim_gpus, holders, capsys):
    h = start_holder((2,), 2048, ignore_term=True)
    holders.append(h)
    assert clean_main(["--gpus", "2", "--grace", "0.2", "--deadline", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "clean" and data["clean"] is True and data["survivors"] == []
    (proc,) = [p for p in data["processes"] if p["pid"] == h.pid]
    assert proc["ended_by"] == "SIGKILL" and proc["gpus"] == [2] and proc["mib"] == 2048
    assert data["gpus"][0] == {"index": 2, "uuid": data["gpus"][0]["uuid"], "name": data["gpus"][0]["name"],
                               "total_mib": 97887, "before_mib": 2048, "after_mib": 0}

    assert clean_main(["--gpus", "0;touch /tmp/pwned-hygiene"]) == 2
    assert "not a GPU index" in capsys.readouterr().err
    assert not os.path.exists("/tmp/pwned-hygiene")
    assert clean_main(["--gpus", "9"]) == 2
    assert "GPU(s) 9 do not exist on local" in capsys.readouterr().err
    assert clean_main(["--host", "ftp://x"]) == 2
    assert "bad target 'ftp://x'" in capsys.readouterr().err
    assert clean_main(["--bogus"]) == 2


def test_no_driver_no_sim_is_unknown_not_clean(monkeypatch, capsys):
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    report = clean_gpus()
    assert report.verdict == "unknown" and not report.clean
    assert report.error is not None and report.error.startswith("no NVIDIA driver and no simulated GPUs")
    assert clean_main([]) == 1
    assert "UNKNOWN" in capsys.readouterr().out


@pytest.mark.slow  # `datagen` subprocesses: `make test`, not `make unit`
def test_console_script_end_to_end(sim_gpus, holders, tmp_path):
    h = start_holder((7,), 3000)
    holders.append(h)
    exe = os.path.join(os.path.dirname(os.sys.executable), "datagen")
    res = subprocess.run([exe, "clean-gpus", "--gpus", "7", "--grace", "1"], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CLEAN" in res.stdout and f"pid {h.pid}" in res.stdout and "ended by SIGTERM" in res.stdout
    assert "GPU 7" in res.stdout and "3000 MiB -> 0 MiB" in res.stdout


def test_clean_then_not_clean_while_a_spared_process_holds_memory(sim_gpus, holders):
    h = start_holder((6,), 2048)
    holders.append(h)
    report = clean_gpus(target="local", gpus=[6], grace_s=1, deadline_s=5)
    assert report.clean and not alive(h.pid)
    sim_gpus.set_allocation(6, 4000, pid=os.getpid())  # ourselves: spared, so never clean
    report = clean_gpus(target="local", gpus=[6], grace_s=0.1, deadline_s=0.2)
    assert report.verdict == "not_clean" and not report.clean
    assert "NOT CLEAN" in report.summary()
    sim_gpus.release_pid(os.getpid())


def test_d_state_survivor_is_reported(sim_gpus):
    report = HygieneReport(
        target="local", backend="sim", selected_gpus=[0], gpus=[], verdict="not_clean", dry_run=False,
        threshold_mib=1024, grace_s=1, deadline_s=1,
        processes=[ProcessFinding(pid=42, user="root", cmdline="python serve.py", gpus=[0], mib=100,
                                  action="kill", reason="holds selected GPU(s) 0", ended_by=None,
                                  state="D", survived=True)],
    )
    assert report.to_dict()["d_state"] == [{"pid": 42, "cmdline": "python serve.py", "state": "D"}]
    assert "SURVIVED in state D (uninterruptible: D)" in report.summary()


def test_gpu_sim_hold_tree_ignoring_sigterm(sim_gpus, reap_pids):
    # The emulator's own holder (`datagen gpu-sim hold`), as other areas' tests use it.
    exe = os.path.join(os.path.dirname(os.sys.executable), "datagen")
    proc = subprocess.Popen([exe, "gpu-sim", "hold", "--gpu", "1", "--mib", "3000", "--ignore-sigterm",
                             "--children", "2", "--child-mib", "500"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    reap_pids.append(proc.pid)
    try:
        deadline = time.monotonic() + 20
        while sim_gpus.snapshot()["gpus"][1]["used_mib"] < 4000 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = {p["pid"] for p in sim_gpus.snapshot()["gpus"][1]["processes"]}
        assert len(held) == 3 and proc.pid in held
        report = clean_gpus(gpus=[1], grace_s=0.3, deadline_s=5)
        assert report.clean
        assert {p.pid: p.ended_by for p in report.killed} == dict.fromkeys(held, "SIGKILL")
    finally:
        proc.kill()
        proc.wait()


def test_empty_gpu_list_is_refused_and_nothing_is_killed(sim_gpus, holders, capsys):
    h = start_holder((1,), 512)
    holders.append(h)
    for value in ("", " ", ","):
        assert clean_main(["--gpus", value, "--grace", "0.2", "--deadline", "2"]) == 2
        err = capsys.readouterr().err
        assert "empty GPU list" in err or "not a GPU index" in err, err
    assert alive(h.pid)
    with pytest.raises(ValueError, match="empty GPU list"):
        clean_gpus(gpus=[])
    assert alive(h.pid)


def test_memory_of_a_spared_process_is_reported_at_once_not_awaited(sim_gpus, holders, reap_pids, capsys):
    target = start_holder((0,), 2048)
    holders.append(target)
    other = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, user=NOBODY)
    reap_pids.append(other.pid)
    try:
        sim_gpus.set_allocation(0, 3000, pid=other.pid)
        t0 = time.monotonic()
        code = clean_main(["--gpus", "0", "--grace", "1", "--deadline", "20", "--json"])
        elapsed = time.monotonic() - t0
        data = json.loads(capsys.readouterr().out)
        assert code == 1 and data["verdict"] == "not_clean"
        assert elapsed < 8, f"waited {elapsed:.1f} s for memory a spared process holds"
        assert data["waited_s"] < 1.0
        assert not alive(target.pid)  # what it chose to end is still ended
        assert alive(other.pid)
        assert (f"GPU 0: 3000 MiB held by spared pid(s) {other.pid}: it cannot become clean while they run, "
                "so the memory deadline was not waited") in data["notes"]
    finally:
        other.kill()
        other.wait()
