# datagen: `make demo` and `make test` work on a fresh clone with only python3 and make.

# Python caches each module's bytecode the first time a process imports it, unless
# PYTHONDONTWRITEBYTECODE is set (these machines and CI set it): then the suite's hundreds of `datagen`,
# Prefect and emulator processes would each compile Prefect and the project from source again.
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install bytecode demo test lint unit bench bench-quick chaos chaos-quick up down clean sglang-cpu specforge-env ui-shots

# uv installs from its cache in about 3 s where pip takes about 50 s (CI starts from a fresh clone); pip
# does it when uv cannot be had. The venv is made without pip (ensurepip took 4.5 s of a fresh clone's
# start): the system's pip puts uv in it, and ensurepip runs only for the pip fallback. No bytecode at
# install: compiling all of site-packages cost about 30 CPU-s, most of it for packages nothing here
# imports; `make bytecode` writes what the processes read.
#
# The libraries only pytest imports (tests/requirements-pytest.txt: selenium, datasets, duckdb) go to
# $(PYTEST_LIBS), outside site-packages, resolved against the venv's versions (a constraints file);
# tests/conftest.py appends it to the pytest processes' sys.path. The processes the tests start see
# the product's dependencies only. A venv made before this layout loses the ones site-packages held.
PYTEST_LIBS := $(VENV)/pytest-libs
PYTEST_ONLY := datasets duckdb selenium trio trio-websocket pandas numpy
$(STAMP): pyproject.toml tests/requirements-pytest.txt
	@test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	@rm -rf $(PYTEST_LIBS)
	@if $(PYTHON) -m pip --python $(PY) install -q uv 2>/dev/null || $(PY) -m pip install -q uv 2>/dev/null; then \
	  $(PY) -m uv pip install -q --python $(PY) -e '.[dev]' && \
	  $(PY) -m uv pip uninstall -q --python $(PY) $(PYTEST_ONLY) 2>/dev/null && \
	  $(PY) -m uv pip freeze --python $(PY) --exclude-editable > $(VENV)/constraints.txt && \
	  $(PY) -m uv pip install -q --python $(PY) --target $(PYTEST_LIBS) -r tests/requirements-pytest.txt \
	    -c $(VENV)/constraints.txt; \
	else \
	  $(PY) -m ensurepip -q && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[dev]' && \
	  $(PY) -m pip freeze --exclude-editable > $(VENV)/constraints.txt && \
	  $(PY) -m pip install -q --target $(PYTEST_LIBS) -r tests/requirements-pytest.txt -c $(VENV)/constraints.txt; \
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

# SpecForge 0.2.0's data path for the `specforge` tier (tests/specforge): its own build_eagle3_dataset
# loads datagen's export. A separate interpreter; built once per recipe outside the checkout.
specforge-env:
	PYTHON=$(PYTHON) tests/specforge/build.sh .venv-specforge

demo: $(STAMP)
	$(VENV)/bin/datagen demo

# The run settings and the flow's parameters are held to --strict (issue 43): every field is typed.
STRICT := tasks/config flows/datagen.py flows/params.py
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy datagen emulator tasks flows
	$(PY) -m mypy --strict --follow-imports=silent $(STRICT)

unit: $(STAMP) bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) tests/unit -m "not slow" -q

# Four pytest-xdist workers on two cores (the suite waits on servers and runs; with three the cores were
# idle 14% of the time), whole files per worker (module fixtures stay shared), handed out heaviest
# first (tests/conftest.py HEAVIEST_FIRST; --no-loadscope-reorder keeps that order: xdist's own puts
# the files with most tests first and left the minute-long one-test files for the end).
# docs/testing.md has the measurements. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 4
# Lint and the bytecode step run side by side: mypy (about 14 s on a fresh clone) keeps one core busy.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j2 lint bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The bytecode the suite's processes read, written once per environment by one process before the
# tests (tests/support/bytecode.py): four workers would otherwise compile the same modules at once.
# Later edits are compiled by the first process that imports them.
BYTECODE := $(VENV)/.bytecode
$(BYTECODE): $(STAMP)
	@$(PY) -m tests.support.bytecode
	@touch $(BYTECODE)

bytecode: $(BYTECODE)

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
