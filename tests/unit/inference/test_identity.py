"""external_fingerprint against real emulator processes: stable across a restart on another port,
different for another model setup, never made from (or holding) the API key."""

from __future__ import annotations

import re

from tasks.inference import IDENTITY_KEYS, external_fingerprint
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import EMU_ARGS


def test_same_server_on_another_port_has_the_same_fingerprint(sim_gpus, emulator_factory):
    first = emulator_factory(EMU_ARGS + ["--served-model-name", "demo"])
    fp, facts = external_fingerprint(first.url)
    assert re.fullmatch(r"external:[0-9a-f]{12}", fp)
    assert facts == {"model_path": str(DEMO_MODEL), "tokenizer_path": str(DEMO_MODEL), "weight_version": "default",
                     "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                     "served_model_name": "demo", "dtype": "auto", "kv_cache_dtype": "auto", "context_length": 262144,
                     "tp_size": 1, "pp_size": 1}
    first.stop()
    again = emulator_factory(EMU_ARGS + ["--served-model-name", "demo", "--mem-fraction-static", "0.7"])
    assert again.port != first.port
    assert external_fingerprint(again.url) == (fp, facts)


def test_another_setup_has_another_fingerprint(sim_gpus, emulator_factory):
    a = emulator_factory(EMU_ARGS + ["--served-model-name", "demo"])
    b = emulator_factory(EMU_ARGS + ["--served-model-name", "demo", "--context-length", "4096", "--base-gpu-id", "1"])
    assert external_fingerprint(a.url)[0] != external_fingerprint(b.url)[0]


def test_api_key_is_sent_never_kept(sim_gpus, emulator_factory):
    em = emulator_factory(EMU_ARGS + ["--api-key", "sk-secret-123"])
    fp, facts = external_fingerprint(em.url, "sk-secret-123")
    assert fp.startswith("external:") and facts["model_path"] == str(DEMO_MODEL)
    assert set(facts) <= set(IDENTITY_KEYS) and "sk-secret-123" not in repr(facts)
    # Without the key neither endpoint answers: the URL is all there is.
    assert external_fingerprint(em.url) == (f"external:{em.url}", {})
