PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed

.PHONY: demo test bench clean

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

# The type checker on src/ (pyproject's [tool.mypy]), then five pytest
# processes: the op tests in two (the kernels' interpret-mode tests make
# hundreds of compiles, and XLA's CPU compiler (jax 0.10.2) once segfaulted
# on a later numerics test in the same process; alone, each set passes);
# the sharding tests, on 8 virtual CPU devices (XLA reads that flag once per
# process); the rest, which imports torch for the transformers parity tests
# (with torch loaded in the same process, XLA's CPU compiler segfaulted
# compiling an op test's autodiff scan); and the deviceless compilation for
# TPU and GPU targets (the kernels; `gdnx plan`'s train step for TPU
# slices), in .venv-aot with libtpu and the CUDA plugin. libtpu admits one
# process at a time. pytest
# exits 5 when it collects nothing: that is a failure too, said plainly.
test: $(STAMP) $(AOT_STAMP)
	@run() { "$$@" || { rc=$$?; [ $$rc -eq 5 ] && echo "make test: pytest collected no tests: $$*" >&2; exit $$rc; }; }; \
	run $(VENV)/bin/python -m mypy && \
	run $(VENV)/bin/python -m pytest tests/ops -m "not deviceless" --ignore=tests/ops/gated_delta_rule/test_numerics.py && \
	run $(VENV)/bin/python -m pytest tests/ops/gated_delta_rule/test_numerics.py && \
	run $(VENV)/bin/python -m pytest tests/parallel && \
	run $(VENV)/bin/python -m pytest tests --ignore=tests/ops --ignore=tests/parallel -m "not deviceless" && \
	run env JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost $(AOT_VENV)/bin/python -m pytest tests/ops tests/test_plan.py -m deviceless

bench: $(STAMP)
	$(VENV)/bin/gdnx bench

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache
