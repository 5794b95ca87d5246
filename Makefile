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

# The CPU stages' programs are tiny and their time goes to compiling them:
# compiled programs are shared between the tests and the processes of one
# run (and kept for the next) by JAX's persistent compilation cache, since
# many tests compile the same tiny model's step; and XLA's CPU backend
# compiles at optimisation level 0, with its elemental emitters rather than
# the fusion emitters and each program's code generated as one module (the
# two halve the compile time of a model's train step; docs/benchmarks.md).
# None of these changes float semantics: no fast math. The deviceless
# stages compile for TPU and GPU targets as a user would.
CPU_ENV := JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 XLA_FLAGS="--xla_backend_optimization_level=0 \
	--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
PYTEST := $(VENV)/bin/python -m pytest -p no:cacheprovider --durations=15 --durations-min=1
AOT_PYTEST := env JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost $(AOT_VENV)/bin/python -m pytest \
	-p no:cacheprovider --durations=15 --durations-min=1 -m deviceless

# The type checker on src/ (pyproject's [tool.mypy]), then the test stages,
# each printing its slowest 15 tests and its time. The CPU stages run on two
# pytest-xdist workers (most of a test is a compile, single-threaded):
# the op tests; the sharding tests, on 8 virtual CPU devices (XLA reads that
# flag once per process); the rest, which imports torch for the
# transformers parity tests (with torch loaded in the same process, XLA's
# CPU compiler segfaulted compiling an op test's autodiff scan). Then the
# deviceless compilation for TPU and GPU targets (the kernels; `gdnx plan`'s
# train step and `gdnx plan --serve`'s engine programs for TPU slices) in
# .venv-aot with libtpu and the CUDA plugin:
# libtpu admits one process at a time, so the TPU targets run in one
# process, and beside it, on the other core, the GPU targets and then the
# op numerics (their own process: XLA's CPU compiler (jax 0.10.2) once
# segfaulted on a numerics test late in a process shared with the kernels'
# interpret-mode tests); those two logs are printed after.
# pytest exits 5 when it collects nothing: that is a failure too, said plainly.
test: $(STAMP) $(AOT_STAMP)
	@stage() { name=$$1; shift; t0=$$(date +%s); "$$@"; rc=$$?; \
	  echo "make test: $$name: $$( [ $$rc -eq 0 ] && echo passed || echo FAILED) in $$(( $$(date +%s) - t0 )) s"; \
	  [ $$rc -eq 5 ] && echo "make test: pytest collected no tests: $$*" >&2; return $$rc; }; \
	stage mypy $(VENV)/bin/python -m mypy && \
	stage "op tests" env $(CPU_ENV) $(PYTEST) -n 2 tests/ops -m "not deviceless" \
	  --ignore=tests/ops/gated_delta_rule/test_numerics.py && \
	stage "8-device tests" env $(CPU_ENV) $(PYTEST) -n 2 --dist loadgroup tests/parallel && \
	stage "the rest" env $(CPU_ENV) $(PYTEST) -n 2 --dist loadgroup tests --ignore=tests/ops --ignore=tests/parallel \
	  -m "not deviceless" && \
	stage "deviceless TPU, beside it deviceless GPU then op numerics" sh -c '( $(AOT_PYTEST) tests/ops \
	  tests/test_train_plan.py tests/serving/test_plan.py -k "h100 or h200 or a100" > .deviceless-gpu.log 2>&1; gpu=$$?; \
	  env $(CPU_ENV) $(PYTEST) -n 1 tests/ops/gated_delta_rule/test_numerics.py > .numerics.log 2>&1; \
	  numerics=$$?; [ $$gpu -eq 0 ] && [ $$numerics -eq 0 ] ) & beside=$$!; \
	  $(AOT_PYTEST) tests/ops tests/test_train_plan.py tests/serving/test_plan.py -k "not h100 and not h200 and not a100"; tpu=$$?; \
	  wait $$beside; rc=$$?; echo "--- deviceless GPU targets:"; cat .deviceless-gpu.log; \
	  echo "--- op numerics:"; cat .numerics.log; [ $$tpu -eq 0 ] && [ $$rc -eq 0 ]'

bench: $(STAMP)
	$(VENV)/bin/gdnx bench

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .jax-cache .deviceless-gpu.log .numerics.log
