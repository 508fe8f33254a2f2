.PHONY: chaos bench

PYTHON ?= .venv/bin/python
TASKS ?= 10000
KILLS ?= 50
SEED ?= 1

# The long chaos run (tests/fault/chaos.py): prints its report as JSON.
chaos:
	$(PYTHON) scripts/chaos.py --tasks $(TASKS) --kills $(KILLS) --seed $(SEED)

# The side-by-side benchmark (docs/benchmarks.md): every system, every workload, 5 runs
# each, alternating; then the plots and the results section of docs/benchmarks.md.
# Narrow it with e.g. BENCH_ARGS="--systems orbit-pg,pgqueuer --runs 3".
BENCH_OUT := benchmarks/results/$(shell date -u +%Y%m%dT%H%M%SZ)
BENCH_ARGS ?=

bench:
	$(PYTHON) -m benchmarks run --out $(BENCH_OUT) $(BENCH_ARGS)
	$(PYTHON) -m benchmarks report $(BENCH_OUT)
