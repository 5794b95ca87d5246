PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gdnx train

# Three pytest processes: the op tests; the sharding tests, on 8 virtual CPU
# devices (XLA reads that flag once per process); then the rest, which
# imports torch for the transformers parity tests. With torch loaded in the
# same process, XLA's CPU compiler segfaulted (jax 0.10.2) compiling an op
# test's autodiff scan. pytest exits 5 when it collects nothing: that is a
# failure too, said plainly.
test: $(STAMP)
	@for args in "tests/ops" "tests/parallel" "tests --ignore=tests/ops --ignore=tests/parallel"; do \
		$(VENV)/bin/python -m pytest $$args; rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests in $$args" >&2; fi; \
		if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

bench: $(STAMP)
	$(VENV)/bin/gdnx bench

clean:
	rm -rf $(VENV) .pytest_cache
