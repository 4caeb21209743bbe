# make serve  — set up .venv (first run) and start the web app + API on the offline default model
# make test   — set up .venv (first run) and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 7860
SERVE_ARGS ?=
# the tested versions of everything (torch included), shared with the Docker images and CI
CONSTRAINTS := constraints.txt
# where torch comes from; empty: pip's index (PyPI's Linux wheel is the CUDA 13.0 build; a +cpu wheel of the same
# version wins where pip finds one, as on CI). https://download.pytorch.org/whl/cpu: the small CPU build.
TORCH_INDEX ?=

.PHONY: setup serve test browser lint

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --constraint $(CONSTRAINTS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PY) -m pip install --quiet --constraint $(CONSTRAINTS) -e ".[test,ray]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/pop-vlm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Debian's Chromium for the browser tests (installed with apt when missing and we may)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is missing: the browser tests will be skipped (sudo apt-get install chromium)"; fi; }

test: setup browser
	$(PY) -m pytest -q
