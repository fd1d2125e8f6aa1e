# `make run` and `make test` create .venv and install what is missing (fast when
# already installed). EXTRAS=gpu,test on CUDA machines.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
EXTRAS ?= cpu,test
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)-$(EXTRAS)
CONFIG ?= serve_configs/local.yaml
# What app/native.py compiles (a superset: any edit here rebuilds, ~30 s)
NATIVE := app/_native/manifest.json
NATIVE_SOURCES := app/native.py app/policy.py app/conductor/prefix_index.py $(wildcard app/sim/*.py app/sim/*.pxd)

.PHONY: run test test-unit lint bench install cluster-up cluster-down prometheus clean

install: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# PyPI's torchvision/torchaudio/torchcodec are built against another torch and
	# break `import transformers` ("operator torchvision::nms does not exist").
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $@

# The digital twin's hot modules compiled by Cython; edited ones run as Python until rebuilt.
$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	$(BIN)/pdd native build

run: install prometheus
	$(BIN)/pdd run $(CONFIG)

test: install prometheus lint
	$(BIN)/python -m pytest tests -q -p no:cacheprovider

# ruff's and mypy's settings are in pyproject.toml; `ruff format app agents bench tests` fixes the format
lint: install
	$(BIN)/ruff check app agents bench tests
	$(BIN)/ruff format --check app agents bench tests
	$(BIN)/mypy

test-unit: install
	$(BIN)/python -m pytest tests/unit -q

bench: install
	$(BIN)/python bench/serve_overhead.py

cluster-up: install
	$(BIN)/pdd cluster up $(CONFIG)

cluster-down: install
	$(BIN)/pdd cluster down

# Debian's prometheus (Ray's `ray metrics launch-prometheus` downloads and fails offline).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing prometheus (apt-get)"; \
	    (apt-get install -y -q prometheus >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null)); \
	  else echo "prometheus not found: install it (Debian/Ubuntu: sudo apt-get install prometheus)"; fi; }

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis app/_native
