# One venv, installed from nothing on first use; every target depends on it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradcomp-installed
NP     ?= 4

.PHONY: install test demo bench bench-capped clean

# constraints.txt pins the versions CI tests (torch among them); setup.cfg states ranges.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpi,torch,test,bench,jax,integrations]' -c constraints.txt
	touch $(STAMP)

install: $(STAMP)

# The type check (mypy, configured in setup.cfg), then the whole suite, multi-rank tests under
# real mpiexec included.
test: $(STAMP)
	$(PY) -m mypy gradcomp
	$(PY) -m pytest

# The digits MLP under mpiexec -n $(NP), once per compressor, one comparison table.
demo: $(STAMP)
	$(PY) scripts/demo.py --np $(NP)

bench: $(STAMP)
	$(PY) -m gradcomp bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache

# ResNet-50-sized step times on a tbf-capped network (needs root; see bench/capped.sh).
bench-capped: $(STAMP)
	bench/capped_steps.sh results/bench
