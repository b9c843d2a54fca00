# The two commands of the README: `make demo` trains, `make test` tests.
# Both create .venv with the interpreter in $(PYTHON) (3.11 or newer) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOWEST := .venv-lowest
#: What the lowest-versions job runs: the library's and the services' tests that start no
#: fleet of processes (not the slow end-to-end runs, which `make test` runs with the newest
#: releases), and no browser or container (their drivers are test tools).
LOWEST_TESTS := -m "not slow and not browser and not containers"
#: Two test processes (pytest-xdist): many tests wait on processes, sockets and timeouts, so
#: two at once finish sooner even on two cores, and the tests hold on a loaded machine.
#: The container tests run afterwards, alone: they share podman's names and images, and
#: starting containers beside a parallel suite on two cores outlasts their start-up bounds.
PARALLEL := -n 2 --dist loadgroup

.PHONY: demo test test-lowest lint clean

demo: $(VENV)/.installed
	$(BIN)/gemq run

test: $(VENV)/.installed-test
	@.ci/install-browser || echo "make test: no chromium, so the browser test will fail"
	$(BIN)/python -m pytest $(PARALLEL) -m "not containers"
	$(BIN)/python -m pytest -m containers

# The lowest-versions job (CI runs it after `make test`): every direct dependency at the
# lower bound of its range in pyproject.toml (.ci/lowest-constraints.py), in a venv of its
# own, then the library's and the services' tests. Proves that each lower bound works.
test-lowest: $(LOWEST)/.installed
	@echo "test-lowest: $$($(LOWEST)/bin/python -m pip list --format=freeze | tr '\n' ' ')"
	$(LOWEST)/bin/python -m pytest $(PARALLEL) $(LOWEST_TESTS)

$(LOWEST)/.installed: pyproject.toml constraints.txt .ci/lowest-constraints.py
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "gemq needs Python 3.11+"'
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python .ci/lowest-constraints.py > $(LOWEST)/lowest.txt
	$(LOWEST)/bin/python -m pip install --quiet -c constraints.txt -c $(LOWEST)/lowest.txt \
		-e '.[embedded,test]'
	touch $@

lint: $(VENV)/.installed-test
	$(BIN)/ruff check gemq services tests
	$(BIN)/mypy

$(VENV)/.created:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "gemq needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[embedded,datasets]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.created pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[embedded,test]'
	touch $@

clean:
	rm -rf $(VENV) $(LOWEST) runs test-artifacts
