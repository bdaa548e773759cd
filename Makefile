# One venv, installed from nothing on first use; every target depends on it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradcomp-installed
NP     ?= 4

.PHONY: install test test-cpus demo bench bench-capped docs clean

# constraints.txt pins the versions CI tests (torch among them); setup.cfg states ranges.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpi,torch,test,bench,jax,integrations,ft]' -c constraints.txt
	touch $(STAMP)

install: $(STAMP)

# The documentation tools (setup.cfg's docs extra) on top of the same venv, installed on first use.
DOCS_STAMP := $(VENV)/.gradcomp-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]' -c constraints.txt
	touch $(DOCS_STAMP)

# The type check (mypy, configured in setup.cfg), then the whole suite, multi-rank tests under
# real mpiexec included.
test: $(STAMP)
	$(PY) -m mypy gradcomp
	$(PY) -m pytest

# The kernels, the codecs and the recorded bits again, compiled for other x86-64 CPUs than this
# one (DESIGN.md, "Same bits on any CPU"): generic (no AVX, no F16C: the NumPy kernels), AVX2 and
# AVX-512 vector widths. About a minute each on 2 cores. Then the recorded bits and the one-rank
# kernel tests under NumPy's own dispatch narrowed (NPY_DISABLE_CPU_FEATURES), as on a CPU
# without AVX-512 (skipped where this one has none) and on one with NumPy's baseline alone (no
# AVX2, FMA3 or AVX-512): under a minute each. NPY_OFF names the dispatched features this CPU has
# (NumPy refuses to disable a baseline one, and names them by version: AVX512_SKX, X86_V4...).
CPUS ?= generic haswell skylake-avx512
NPY_OFF = $(PY) -c "import sys, numpy; u = getattr(numpy, '_core', None) or numpy.core; u = u._multiarray_umath; \
  print(' '.join(f for f in u.__cpu_dispatch__ if u.__cpu_features__.get(f) and \
                 (sys.argv[1] == 'all' or f.startswith('AVX512') or f == 'X86_V4')))"
test-cpus: $(STAMP)
	for cpu in $(CPUS); do \
	  echo "== NUMBA_CPU_NAME=$$cpu"; \
	  NUMBA_CPU_NAME=$$cpu $(PY) -m pytest -q -p no:cacheprovider tests/kernels tests/compressors/test_same_bits.py \
	    tests/compressors/test_codecs.py || exit 1; \
	done
	for narrow in avx512 all; do \
	  off=$$($(NPY_OFF) $$narrow) || exit 1; \
	  if [ -z "$$off" ]; then echo "== NumPy without $$narrow: this CPU has none of it"; continue; fi; \
	  echo "== NPY_DISABLE_CPU_FEATURES=\"$$off\""; \
	  NPY_DISABLE_CPU_FEATURES="$$off" $(PY) -m pytest -q -p no:cacheprovider tests/compressors/test_same_bits.py \
	    tests/kernels -k "recorded or not (test_same_bits or three_ranks or 8-3 or jit_0 or never_imports)" \
	    || exit 1; \
	done

# The digits MLP under mpiexec -n $(NP), once per compressor, one comparison table.
demo: $(STAMP)
	$(PY) scripts/demo.py --np $(NP)

bench: $(STAMP)
	$(PY) -m benchmarks bench

# The documentation site (mkdocs.yml, docs/) into site/; any warning is an error (--strict), then
# an offline check of every link and anchor in the built pages.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	$(PY) scripts/check_site_links.py site

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache

# ResNet-50-sized step times on a tbf-capped network (needs root; see benchmarks/capped.sh).
bench-capped: $(STAMP)
	benchmarks/capped_steps.sh results/bench
