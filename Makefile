# Tether task runner. `make demo` and `make test` each set up everything first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: constraints setup demo test test-unit test-integration test-stress chaos lint typecheck fmt bench \
	bench-quick clean test-long redis-check prometheus-check bwrap-check proto bytecode

setup: $(STAMP) bytecode redis-check prometheus-check bwrap-check

$(STAMP): pyproject.toml constraints.txt
	@test -d $(VENV) || $(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@echo "installing tether with dev extras into $(VENV) (first run takes a few minutes)..."
	@$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

constraints: $(STAMP)
	@(echo "# Versions the suite was last run green with; \`make setup\` installs within them (regenerate: make constraints)."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^tether' | sort -f) > constraints.txt

# Every Ray worker imports the product's modules (176 files). With no compiled bytecode on disk (an editable install,
# under PYTHONDONTWRITEBYTECODE as here) each worker compiles them again from source: ~0.2 s of CPU and
# ~1.7 MB of private memory per trajectory process. Compiled once here; a no-op while the sources are unchanged.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q runtime scheduler breakers actors cluster testbed

redis-check:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "redis-server not found: installing it with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
		systemctl disable --now redis-server >/dev/null 2>&1 || service redis-server stop >/dev/null 2>&1 || true; \
	else \
		echo "redis-server is required. Install it with: sudo apt-get install redis-server (or brew install redis)"; \
		exit 1; \
	fi

# Prometheus and promtool (Debian package `prometheus`): the metrics tests start a real server with the shipped
# scrape config and run promtool on the shipped rules. Installed when missing; its system service is not run.
prometheus-check:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "prometheus not found: installing it with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
		systemctl disable --now prometheus >/dev/null 2>&1 || service prometheus stop >/dev/null 2>&1 || true; \
	else \
		echo "prometheus (server and promtool) is required. Install it with: sudo apt-get install prometheus"; \
		exit 1; \
	fi

# Sandboxed commands run under bubblewrap (own PID and network namespace, read-only root): installed like
# redis-server when missing; without it (and without unshare) the sandbox falls back to a process group.
bwrap-check:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "bwrap not found: installing bubblewrap with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	else \
		echo "warning: bwrap (bubblewrap) is not installed; sandboxes fall back to unshare or a process group." \
			"Install it with: sudo apt-get install bubblewrap"; \
	fi

demo: setup
	$(BIN)/tether run examples/quickstart.yaml --report .tether/reports/quickstart.json

# The whole suite stops starting new tests after TEST_BUDGET_S seconds (it then fails, with the summary of
# where the time went), so a machine much slower than expected still ends with a report; should a test hang
# where its own timeout cannot reach, pytest is interrupted (SIGINT: it still prints its summary) 15 minutes
# after the budget.
TEST_BUDGET_S ?= 3600

# `make test` (what CI runs) leaves out the tests marked `long`: each spends minutes of wall time, mostly
# waiting (the chaos suite's two seeded runs, the parked fleet, the autoscaler's scale-out and scale-in, the
# LiteLLM proxy's real rpm windows). On a slower 2-core machine they pushed the suite past 35 minutes, and
# the LiteLLM module, run beside the suite, failed its timing under that load. `make test-long` runs them
# alone; `make test-stress` runs them with the rest of the integration and fault tiers under load.
#
# The suite runs in TEST_WORKERS pytest-xdist workers (whole modules to one worker, so module fixtures are set
# up once; each worker has its own shared local Ray and Ray temp dir, see tests/conftest.py;
# --no-loadscope-reorder keeps the modules in the order tests/conftest.py gives them). Most of a Ray test's time
# is waiting (on a rate limit, a timer, a process): on 2 cores two workers took 1,188 s (CPU 88 % busy) where
# one took 1,670 s (a Ray module alone keeps it ~59 % busy). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
WORKERS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	timeout -s INT -k 120 $$(( $(TEST_BUDGET_S) + 900 )) $(BIN)/pytest -q --durations=10 \
		$(WORKERS) --session-timeout=$(TEST_BUDGET_S) -m "not long"

test-long: setup
	timeout -s INT -k 120 $$(( $(TEST_BUDGET_S) + 900 )) $(BIN)/pytest -q --durations=10 \
		--session-timeout=$(TEST_BUDGET_S) -m long

# The integration and fault tiers, `long` tests included, beside two busy loops (one per core of the 2-core
# machine the suite is sized for): a shared CI machine. They run in TEST_WORKERS workers, as `make test` does.
# The loops are stopped by their pids whatever pytest does (trap on exit).
test-stress: setup
	@$(BIN)/python -c 'while True: pass' & b1=$$!; $(BIN)/python -c 'while True: pass' & b2=$$!; \
	trap 'kill $$b1 $$b2 2>/dev/null; wait $$b1 $$b2 2>/dev/null; echo "busy loops $$b1 $$b2 stopped"' EXIT; \
	echo "busy loops running: $$b1 $$b2"; \
	TETHER_PARKED_FLEET=50 timeout -s INT -k 120 $$(( $(TEST_BUDGET_S) + 900 )) $(BIN)/pytest -q --durations=10 \
		$(WORKERS) --session-timeout=$(TEST_BUDGET_S) tests/integration tests/faults

# The chaos suite (benchmarks/chaos.py): CHAOS_SEEDS seeded fault schedules against CHAOS_TRAJECTORIES
# trajectories each; results in benchmarks/results/chaos.json.
CHAOS_SEEDS ?= 20
CHAOS_TRAJECTORIES ?= 100
chaos: setup
	$(BIN)/python -m benchmarks.chaos --seeds $(CHAOS_SEEDS) --trajectories $(CHAOS_TRAJECTORIES) \
		--out benchmarks/results/chaos.json

test-unit: setup
	$(BIN)/pytest -q tests/unit

test-integration: setup
	$(BIN)/pytest -q tests/integration tests/faults

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup
	$(BIN)/mypy runtime scheduler breakers actors cluster testbed

# The full set at default settings (headline results, about 2 hours on 2 cores), then the README table.
# bench-quick checks every benchmark works in minutes; it writes <name>.quick.json, never the headline files.
BENCHES := log_append turn_overhead model_path guard_throughput node_capacity rate_limit shared_limits \
	retry_storm control_latency

bench: setup
	@set -e; for b in $(BENCHES); do echo "== benchmarks.$$b"; $(BIN)/python -m benchmarks.$$b; done
	@echo "== benchmarks.rate_limit --scenario interactive_users"
	$(BIN)/python -m benchmarks.rate_limit --scenario interactive_users
	@echo "== benchmarks.rate_limit, with the top class's reserve"
	$(BIN)/python -m benchmarks.rate_limit --policies tether,tether_reserve --out benchmarks/results/rate_limit.reserve.json
	@echo "== benchmarks.rate_limit --scenario interactive_users, with the top class's reserve"
	$(BIN)/python -m benchmarks.rate_limit --scenario interactive_users --policies tether,tether_reserve,static_split \
		--out benchmarks/results/rate_limit.interactive_users.reserve.json
	@if [ -f benchmarks/chaos.py ]; then echo "== benchmarks.chaos"; $(BIN)/python -m benchmarks.chaos; fi
	$(BIN)/python -m benchmarks.readme_table

bench-quick: setup
	@set -e; for b in $(filter-out control_latency,$(BENCHES)); do echo "== benchmarks.$$b --quick"; \
		$(BIN)/python -m benchmarks.$$b --quick; done
	$(BIN)/python -m benchmarks.rate_limit --quick --scenario interactive_users

clean:
	rm -rf $(VENV) .tether .pytest_cache .mypy_cache .ruff_cache build *.egg-info
	find runtime scheduler breakers actors cluster testbed benchmarks tests -name __pycache__ -prune -exec rm -rf {} +
