PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed

.PHONY: demo test test-all bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(AOT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AOT_VENV)/bin/python -m pip install --quiet -e '.[aot]'
	touch $(AOT_STAMP)

demo: $(STAMP)
	$(VENV)/bin/gdnx train

# The test tiers (tests/stages.py runs their stages and prints each one's
# time): `make test` leaves out the tests marked slow or multiprocess (about
# 9 minutes on 2 cores from a clean cache), `make test-all` runs every test
# (about an hour: 53 and 67 minutes measured) and writes its stamp (tree, date, each stage's time and
# result) to test-all.stamp. Both install .venv and .venv-aot (libtpu and
# the CUDA plugin, for the deviceless compiles) first.
test: $(STAMP) $(AOT_STAMP)
	$(VENV)/bin/python tests/stages.py fast --stamp test.stamp

test-all: $(STAMP) $(AOT_STAMP)
	$(VENV)/bin/python tests/stages.py all --stamp test-all.stamp

bench: $(STAMP)
	$(VENV)/bin/gdnx bench

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .jax-cache .test-logs test.stamp test-all.stamp
