# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates .venv with the pinned constraints on first use, so a fresh clone needs only Python >= 3.11.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
EXTRAS ?= cpu,train,dev,faiss
STAMP  := $(VENV)/.installed-$(shell echo $(EXTRAS) | tr ',' '-')

.PHONY: demo test install protos bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

# The main job: train v1/v2 on digits, serve them on loopback, upgrade a fleet of devices in
# place, backfill one from the encrypted vault; the table and report land in runs/demo/.
demo: $(STAMP)
	$(BIN)/fctkit demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
