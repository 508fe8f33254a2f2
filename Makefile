.PHONY: chaos

PYTHON ?= .venv/bin/python
TASKS ?= 10000
KILLS ?= 50
SEED ?= 1

# The long chaos run (tests/fault/chaos.py): prints its report as JSON.
chaos:
	$(PYTHON) scripts/chaos.py --tasks $(TASKS) --kills $(KILLS) --seed $(SEED)
