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

# Until `fctkit demo` (the end-to-end device demo) lands, the main job is the trainer on digits:
# old/new backbones, SimCLR side-info, every adapter method, the full report in runs/demo/.
demo: $(STAMP)
	$(BIN)/fctkit train --config configs/digits.toml --out runs/demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
