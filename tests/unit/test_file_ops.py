"""Nothing in the product reaches a file under OUT by its name: every such call is in tasks/files.py.

Issue 47: a by-name operation under the output follows a name an attacker with write access to OUT
swapped for a symlink. ``tasks.files.Dir`` does every operation relative to a held directory handle;
this test lists every other call in the product that opens, creates, renames, lists or deletes a
path by name (``tests/support/file_ops.py``), function by function, with why it is not under OUT.
A new by-name call anywhere fails it until it is either moved onto a ``Dir`` or added here with its
reason; a listed call that is gone fails it too, so the list stays exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.file_ops import by_name_calls, scan_source

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("datagen", "tasks", "flows", "emulator")
OWNER = "tasks/files.py"

# Where a file lies outside OUT, or why the call is safe under it. Outside OUT: the run directory
# ($DATAGEN_RUN_DIR: pid files, the API server's state, run records), Prefect's home, the fraction
# memory, the configuration, the input and the model directory, /proc and /dev.
RUN_DIR = "the run directory ($DATAGEN_RUN_DIR), never under an output"
ALLOWED: dict[str, tuple[str, dict[str, int]]] = {
    "datagen/_api_server.py": (RUN_DIR + ": the API server's pid, url and log files", {
        "_spawn open()": 1, "_tail .read_text()": 1, "end_orphans .glob()": 1, "end_orphans .read_text()": 1,
        "end_orphans .unlink()": 2, "owned_api .mkdir()": 1, "owned_api .unlink()": 2,
        "owned_api atomic_write_json": 1}),
    "datagen/cli.py": ("/dev/null as stdout after a broken pipe", {"main os.open": 1}),
    "datagen/cmd_demo.py": ("OUT itself, the demo's own output, reached by its path (its parent is trusted); "
                            "shutil.rmtree walks by handle (rmtree.avoids_symlink_attacks)", {"main shutil.rmtree": 1}),
    "datagen/cmd_export.py": ("the export file, which check_export_target refuses inside the output",
                              {"main atomic_writer": 1}),
    "datagen/cmd_run.py": (RUN_DIR + ": the API url file", {"_up_api_url open()": 1}),
    "datagen/cmd_up.py": (RUN_DIR + " and Prefect's home: pids, logs, the deployment file", {
        "_control_env .mkdir()": 1, "_read_pid .read_text()": 1, "_start open()": 1, "_start_of .mkdir()": 1,
        "_start_server .read_text()": 1, "_start_server .write_text()": 1, "_tail .read_text()": 1,
        "_worker_api_url .read_text()": 1, "_write_pid atomic_write_json": 1, "deployments_of .read_text()": 1,
        "down .glob()": 1, "down .unlink()": 2, "up .write_text()": 1, "up open()": 1}),
    "tasks/card.py": ("parses bytes read through the output's handles (pa.BufferReader)", {"_values pq.ParquetFile": 1}),
    "tasks/config/_checks.py": ("a probe directory made by tempfile in a directory the user names for a "
                                "setting, removed by the name mkdtemp returned", {"writable_dir os.rmdir": 1}),
    "tasks/config/_load.py": ("the partition configuration files", {
        "list_partitions .glob()": 1, "load_partition .read_text()": 1}),
    "tasks/export.py": ("parses bytes read through the output's handles (io.BytesIO)", {
        "iter_export pq.ParquetFile": 1, "resplit pq.read_table": 1}),
    "tasks/gpus.py": ("/proc and /dev (process and device discovery)", {
        "_cmdline open()": 1, "_new_descendants os.listdir": 1, "_nvidia_devices os.listdir": 1,
        "_smi_is_stand_in open()": 1, "_socket_owners os.listdir": 2, "_stat open()": 1, "_uid open()": 1,
        "port_listeners open()": 1, "scan_procs os.listdir": 1}),
    "tasks/hygiene/__init__.py": ("the hygiene script's own source, read to ship it to a target",
                                  {"_bootstrap open()": 1}),
    "tasks/inference/_pool.py": ("a gate of the dispatch queue, not a file", {"InferencePool._worker .open()": 1}),
    "tasks/inference/_provenance.py": ("the model directory", {
        "model_revision .iterdir()": 1, "model_revision .read_bytes()": 1}),
    "tasks/inference/_records.py": ("the input file", {"estimate_records open()": 1, "estimate_records pq.ParquetFile": 1}),
    "tasks/inference/_resume.py": ("parses a shard opened through the output's handles (OutputDir.shard_reader)",
                                   {"_newest_shard_row pq.read_table": 1}),
    "tasks/prompts.py": ("the input file and the model directory's chat template", {
        "ChatTemplate.from_model_dir .read_text()": 1, "_iter_jsonl open()": 1, "_iter_parquet pq.ParquetFile": 1,
        "_read_json read_json_object": 1, "check_input open()": 1, "check_input pq.ParquetFile": 1,
        "input_fingerprint open()": 1}),
    "tasks/reasoning/__init__.py": ("the model directory's config", {"parser_for_model read_json_object": 1}),
    "tasks/server/_launch.py": ("the server log, through the log directory's handle opened O_NOFOLLOW "
                                "(tasks.files.open_below)", {
        "_tail open_below": 1, "_read_log_from open_below": 1, "_start_local open_below": 1,
        "_start_rank open_below": 1}),
    "tasks/server/_memory.py": ("the fraction memory (~/.cache/datagen or $DATAGEN_MEMORY)", {
        "FileStore._locked .mkdir()": 1, "FileStore._locked open()": 1, "FileStore._read .read_text()": 1,
        "FileStore._write atomic_write_json": 1}),
    "tasks/shards/_commit.py": ("writes into an in-memory buffer", {"parquet_bytes pq.write_table": 1}),
    "tasks/shards/_output.py": ("OUT itself, chosen by the user (its parent is trusted): the one path opened",
                                {"OutputDir.open_root Dir.open": 1}),
    "tasks/shards/_rebuild.py": ("parses bytes read through the dataset directory's handle", {"_check pq.read_table": 1}),
    "tasks/shards/_versions.py": ("the versioned root and ROOT/versions, the parent of the run's OUT (trusted)", {
        "choose_version Dir.open": 1, "mark_failed Dir.open": 1, "promote_latest Dir.open": 1}),
    "tasks/targets.py": ("an SSH connection, and a detached command's log through its directory's handle", {
        "_open .open()": 1, "start_detached open_below": 1}),
    "tasks/validation/_output.py": ("parses bytes read through the output's handles", {"_validate_shard pq.read_table": 1}),
    "flows/names.py": ("the word lists shipped with the package", {"_slug_words .iterdir()": 1, "_slug_words .read_text()": 1}),
    "flows/runrecord.py": (RUN_DIR + ": the run records", {
        "_write .mkdir()": 1, "_write atomic_write_json": 1, "prune .glob()": 1, "prune .unlink()": 1,
        "read .read_text()": 1, "records .glob()": 1}),
    "emulator/cli.py": ("the emulator's --emu-request-log and --emu-request-times files (a test's)",
                        {"Main.serve open()": 2}),
    "emulator/nvidia_smi.py": ("/proc", {"_proc_name open()": 1}),
    "emulator/profile.py": ("the model directory's config", {"load_model open()": 2}),
    "emulator/simgpu.py": ("the simulated-GPU file, directly in OUT or where $DATAGEN_SIM_GPUS says: opened "
                           "O_NOFOLLOW relative to its directory's handle (OUT, trusted as reached)", {
        "SimGpus._locked open_for_write": 1, "SimGpus._read read_nofollow": 1, "SimGpus._write atomic_write_json": 1,
        "SimGpus.init os.makedirs": 1}),
}


def test_every_by_name_file_operation_in_the_product_is_listed_with_why_it_is_not_under_out() -> None:
    found = by_name_calls(ROOT, PACKAGES, OWNER)
    problems = []
    for module in sorted(set(found) | set(ALLOWED)):
        have = dict(found.get(module, {}))
        allowed = ALLOWED.get(module, ("", {}))[1]
        for site in sorted(set(have) | set(allowed)):
            if have.get(site, 0) > allowed.get(site, 0):
                problems.append(f"{module}: {site} reaches a file by name ({have[site]} call(s), {allowed.get(site, 0)} "
                                f"allowed): go through tasks.files.Dir (OutputDir's handles) if the file can lie "
                                f"under OUT, else add it to ALLOWED with the reason")
            elif have.get(site, 0) < allowed.get(site, 0):
                problems.append(f"{module}: {site} is listed in ALLOWED {allowed[site]} time(s) but found "
                                f"{have.get(site, 0)}: update the list")
    assert problems == []


@pytest.mark.parametrize(("source", "site"), [
    ("def f(out):\n    (out / 'x').write_text('y')\n", "f .write_text()"),
    ("def f(out):\n    open(out / '_manifest.json')\n", "f open()"),
    ("import os\nclass C:\n    def g(self, p):\n        os.unlink(p)\n", "C.g os.unlink"),
    ("def f(p, q):\n    p.replace(q)\n", "f .replace()"),
    ("import pyarrow.parquet as pq\ndef f(p):\n    return pq.read_table(p)\n", "f pq.read_table"),
    ("from tasks.files import atomic_write_json\ndef f(p):\n    atomic_write_json(p, {})\n", "f atomic_write_json"),
    ("import shutil\ndef f(p):\n    shutil.rmtree(p)\n", "f shutil.rmtree"),
])
def test_the_scan_finds_an_added_by_name_operation(source: str, site: str) -> None:
    assert scan_source(source) == {site: 1}


def test_the_scan_leaves_handle_operations_and_looks_alone() -> None:
    source = ("import os\ndef f(d, p, s):\n    d.read('x'); d.write('x', b''); d.remove('x'); d.remove_dir('y')\n"
              "    os.path.exists(p); p.is_dir(); s.replace('a', 'b'); os.fdopen(3)\n")
    assert scan_source(source) == {}


def test_a_by_name_operation_added_to_a_module_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "files.py").write_text("import os\nos.unlink('x')\n")  # the owner: not scanned
    (tmp_path / "tasks" / "card.py").write_text("def write_card(out):\n    (out / 'README.md').write_bytes(b'')\n")
    assert by_name_calls(tmp_path, ("tasks",), "tasks/files.py") == {"tasks/card.py": {"write_card .write_bytes()": 1}}
