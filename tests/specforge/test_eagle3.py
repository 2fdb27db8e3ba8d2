"""The `specforge` tier: SpecForge 0.2.0's own ``build_eagle3_dataset`` loads `datagen export --format
specforge`, and what it trains on agrees with `datagen export --tokenizer`'s check (issue 48 item 5).

The tiny model's chat template (ChatML, as Qwen2's) ignores ``reasoning_content``: SpecForge (with its
thinking template, ``qwen3-thinking``) trains none of the reasoning, and the export's check says 0%
survives. With a template that renders it (Qwen3's way), SpecForge trains every row's reasoning, and the
check says 100%. SpecForge's general templates (``qwen``) drop ``reasoning_content`` whatever the model's
template. Runs from .venv-specforge
(`make specforge-env`; skipped without it, failed under CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.outputs import REASONING_TEMPLATE, clean_rows, write_output
from tests.support.paths import REPO_ROOT
from tests.support.sglang import DATAGEN

pytestmark = [pytest.mark.slow, pytest.mark.specforge]
VENV = REPO_ROOT / ".venv-specforge"
ROWS = 12


# Run by SpecForge's interpreter: its build_eagle3_dataset on the export, then, per row, whether the
# reasoning is among the tokens its loss mask trains.
LOAD = r"""
import json, sys
from datasets import Dataset
from transformers import AutoTokenizer
from specforge.data.preprocessing import build_eagle3_dataset
model, export, template = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(line) for line in open(export)]
tok = AutoTokenizer.from_pretrained(model)
built = build_eagle3_dataset(Dataset.from_list(rows), tok, chat_template=template, max_length=1024, num_proc=1)
# build_eagle3_dataset shuffles: a trained text is matched against every row's reasoning
reasonings = [(r["conversations"][-1].get("reasoning_content") or "").strip()[:40] for r in rows]
trained, with_reasoning = [], 0
for ids, mask in zip(built["input_ids"], built["loss_mask"]):
    ids, mask = list(ids[0]) if hasattr(ids[0], "__len__") else list(ids), list(mask[0]) if hasattr(mask[0], "__len__") else list(mask)
    text = tok.decode([int(i) for i, m in zip(ids, mask) if int(m)])
    trained.append(sum(int(m) for m in mask))
    with_reasoning += any(r and r in text for r in reasonings)
print(json.dumps({"loaded": len(built), "nonempty": sum(1 for t in trained if t), "reasoning_trained": with_reasoning,
                  "mean_trained": sum(trained) / len(trained)}))
"""


@pytest.fixture(scope="module")
def specforge_python() -> Path:
    python = VENV / "bin" / "python"
    if python.is_file():
        return python
    why = f"SpecForge environment {VENV} is missing: run `make specforge-env`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI runs the specforge tier; .ci/run builds it before the tests)")
    pytest.skip(why)


def _export(out: Path, target: Path, tokenizer: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DATAGEN, "export", str(out), "--format", "specforge", "--out", str(target),
                           "--tokenizer", str(tokenizer)], capture_output=True, text=True, timeout=120)


def _specforge(python: Path, model: Path, export: Path, template: str = "qwen3-thinking") -> dict:
    res = subprocess.run([str(python), "-c", LOAD, str(model), str(export), template], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_specforge_loads_the_export_and_trains_what_the_template_check_says(
        specforge_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    out = write_output(tmp_path / "out", {"ds": [clean_rows("ds", ROWS)]}, shard_size=ROWS)  # every row reasons

    drops = _export(out, tmp_path / "drops.jsonl", tiny_model)
    assert drops.returncode == 0, drops.stderr
    assert f"reasoning survives in 0 of {ROWS} rows with reasoning (0%)" in drops.stderr
    assert "datagen export: warning: the chat template of" in drops.stderr
    seen = _specforge(specforge_python, tiny_model, tmp_path / "drops.jsonl")
    assert (seen["loaded"], seen["nonempty"], seen["reasoning_trained"]) == (ROWS, ROWS, 0), seen

    keeps = tmp_path / "keeps-model"
    shutil.copytree(tiny_model, keeps)
    config = json.loads((keeps / "tokenizer_config.json").read_text())
    (keeps / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": REASONING_TEMPLATE}))
    (keeps / "chat_template.jinja").unlink(missing_ok=True)
    kept = _export(out, tmp_path / "keeps.jsonl", keeps)
    assert kept.returncode == 0, kept.stderr
    assert f"reasoning survives in {ROWS} of {ROWS} rows with reasoning (100%)" in kept.stderr
    assert "warning" not in kept.stderr
    trained = _specforge(specforge_python, keeps, tmp_path / "keeps.jsonl")
    assert (trained["loaded"], trained["nonempty"], trained["reasoning_trained"]) == (ROWS, ROWS, ROWS), trained
    assert trained["mean_trained"] > seen["mean_trained"]  # the reasoning's tokens, trained now
    # SpecForge's general templates (qwen, llama3, ...) drop reasoning_content before rendering, whatever
    # the model's template: only its thinking templates train it (docs/output.md)
    general = _specforge(specforge_python, keeps, tmp_path / "keeps.jsonl", "qwen")
    assert (general["loaded"], general["reasoning_trained"]) == (ROWS, 0), general
