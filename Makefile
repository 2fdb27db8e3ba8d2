# datagen: `make demo` and `make test` work on a fresh clone with only python3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install bytecode demo test lint unit bench bench-quick chaos chaos-quick up down clean sglang-cpu ui-shots

# uv installs from its cache in about 20 s where pip takes about 50 s (CI starts from a fresh clone);
# pip does it when uv cannot be had. --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is
# set (CI here) no .pyc is ever written later, and every process would compile Prefect's server anew.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -m pip install -q uv 2>/dev/null; then \
	  $(PY) -m uv pip install -q --compile-bytecode --python $(PY) -e '.[dev]'; \
	else \
	  $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[dev]'; \
	fi
	@touch $(STAMP)

install: $(STAMP)

# Real SGLang on CPU for the `sglang` test tier (tests/sglang): a separate interpreter, as [server] python
# names in production. Rebuilt when its recipe changes; pip's cache makes a rebuild fast.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): tests/sglang/env/build.sh tests/sglang/env/requirements.txt tests/sglang/env/shims/vllm/_custom_ops.py
	PYTHON=$(PYTHON) tests/sglang/env/build.sh $(SGLANG_VENV)

sglang-cpu: $(SGLANG_STAMP)

demo: $(STAMP)
	$(VENV)/bin/datagen demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy datagen emulator tasks flows

unit: $(STAMP) bytecode
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) tests/unit -m "not slow" -q

# Four pytest-xdist workers on two cores (the suite waits on servers and runs; with three the cores were
# idle 14% of the time), whole files per worker (module fixtures stay shared), handed out heaviest
# first (tests/conftest.py HEAVIEST_FIRST; --no-loadscope-reorder keeps that order: xdist's own puts
# the files with most tests first and left the minute-long one-test files for the end).
# docs/testing.md has the measurements. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 4
# PYTHONDONTWRITEBYTECODE emptied for pytest: it then caches its rewritten test modules (collection in
# each worker: 4.6 CPU-s instead of 8.4).
test: lint bytecode
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The project's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (CI here) Python never
# caches them, and each of the suite's hundreds of `datagen`, emulator and flow-run processes compiled
# them again (0.23 CPU-s each; docs/testing.md). Python still reads a .pyc and recompiles an edited file.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 datagen tasks flows emulator tests bench >/dev/null

bench: $(STAMP) bytecode
	$(PY) bench/run.py

bench-quick: $(STAMP) bytecode
	$(PY) bench/run.py --quick

chaos: $(STAMP) bytecode
	$(PY) bench/chaos.py --rounds 30

chaos-quick: $(STAMP) bytecode
	$(PY) bench/chaos.py --rounds 3

up: $(STAMP)
	$(VENV)/bin/datagen up

down: $(STAMP)
	$(VENV)/bin/datagen down

# The README's Prefect UI screenshots (docs/ui/*.png): the UI tests in a real headless Chromium
# (apt-get install chromium chromium-driver) against `datagen up` on a spare port, with a relaunched
# and a failed-validation run.
ui-shots: $(STAMP)
	DATAGEN_UI_SHOTS=$(CURDIR)/docs/ui $(PY) -m pytest tests/e2e/test_ui.py -p no:cacheprovider -q

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
