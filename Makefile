# make serve  — set up .venv (first run) and start the web app + API on the offline default model
# make test   — set up .venv (first run) and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 7860
SERVE_ARGS ?=

.PHONY: setup serve test browser lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# the CPU wheel of torch where there is no NVIDIA GPU; the default (CUDA) build where there is one
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch; \
	else $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e ".[test,ray]"
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
