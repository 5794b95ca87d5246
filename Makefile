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

# pytest exits 5 when it collects nothing: that is a failure too, said plainly.
test: $(STAMP)
	@$(VENV)/bin/python -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/ops_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache
