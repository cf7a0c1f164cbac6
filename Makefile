# flowsieve: `make run` starts the daemon on its embedded defaults, `make test` runs the tests.
# Both create .venv and install from pyproject.toml when needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUNTIME := $(VENV)/.installed-runtime
CONFIG ?= config.example.yaml

.PHONY: run test test-long test-fast test-install crash-matrix bench lint java tools clean

# `make run`: the daemon's dependencies only (and scapy's, for live capture), then `flowsieve
# prepare`: numba's kernels compiled and the JVM's class-data archive made (about a minute),
# so that the first run is as fast as the second
$(RUNTIME): pyproject.toml | java
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "flowsieve needs Python >= 3.11 ($(PYTHON) is older)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[live]'
	$(BIN)/flowsieve prepare
	@touch $(RUNTIME)

# tests, benchmarks and linting: the development extras besides
$(STAMP): $(RUNTIME) pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# the external tools of the tests (.ci/tools.txt): one line each that is missing
tools:
	@.ci/check-tools

java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "Java 17 is required by Apache Spark and was not found."; \
	  echo "  Debian/Ubuntu: sudo apt-get install -y openjdk-17-jre-headless"; \
	  echo "  macOS:         brew install openjdk@17"; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -n "$$v" ] && [ "$$v" -lt 17 ]; then \
	    echo "Java $$v found; Apache Spark needs Java 17 or newer"; \
	    echo "  Debian/Ubuntu: sudo apt-get install -y openjdk-17-jre-headless"; exit 1; fi

run: $(RUNTIME) java
	$(BIN)/flowsieve run --config $(CONFIG)

# The whole suite, slow (Spark, daemon) tests included, but the long lane (make test-long);
# exit code 5 (no tests) is a failure. Two workers, a test file each at a time: the slow tests
# mostly wait (a JVM, a window).
test: $(STAMP) java tools
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=12 -m "not long"

# The long lane (marker long): every crash point of tests/test_crash_points.py at its first
# and a later hit, 1,000 queries hot-swapped under traffic, a window of 4M groups on the
# two-worker cluster. CI runs it after make test.
test-long: $(STAMP) java tools
	FLOWSIEVE_CRASH_MATRIX=all $(BIN)/python -m pytest -q -n 2 --dist load -m long \
	  --durations=8

# The crash chains alone (test-long runs them too)
crash-matrix: $(STAMP) java tools
	FLOWSIEVE_CRASH_MATRIX=all $(BIN)/python -m pytest -q -n 2 --dist load \
	  tests/test_crash_points.py -k test_crash_at_each_durable_step

# The product as a user installs it (tests/install/): from a clean clone of the commit, make
# run's own install and the lock's (the image's) each run the daemon until the shipped queries
# answer, and replay; ten stops under traffic. CI runs it after make test (.ci/run).
test-install: $(STAMP) java
	FLOWSIEVE_INSTALL_LANE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/install \
	  --durations=10

# Everything that starts no JVM and no daemon (tests/lanes.py), in under two minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP) java
	@if ls bench/bench_*.py bench/*/bench_*.py >/dev/null 2>&1; then \
	  for b in bench/bench_*.py bench/*/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done; \
	else echo "no benchmarks yet (bench/bench_*.py)"; fi

lint: $(STAMP)
	$(BIN)/ruff check capture planner collector api tests

clean:
	rm -rf var .pytest_cache .ruff_cache .hypothesis
