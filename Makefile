# Two commands for a new user: `make run` (the app on the built-in models) and `make test`.
# Both create .venv if needed and install the pinned dependencies once (re-run only when
# pyproject.toml changes), so later calls start in seconds.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install run test chromium lint

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# Browser tests drive Debian's Chromium (never `playwright install`: it downloads a browser).
chromium:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

run: $(STAMP)
	$(PY) -m app.serve --server.address 127.0.0.1 --server.port 8501 \
		--server.headless true --browser.gatherUsageStats false

test: $(STAMP) chromium
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=20

lint: $(STAMP)
	$(VENV)/bin/ruff check engine app tests bench
