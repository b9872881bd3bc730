# `make demo` starts with `make install-core` (a .venv with torch and hvdlite's own few
# dependencies: what the demo needs); `make test` with `make install`, which adds everything
# else to the same .venv (MPI, TensorFlow, Spark, Ray, Lightning, Hugging Face, Sphinx, pytest).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install install-core demo lint format test test-slow bench docs clean

install-core: $(VENV)/.installed-core

# torch pinned on the same line: 2.13.0 is the CPU build on this machine's disk (never a CUDA
# download); the rest is setup.cfg's install_requires
$(VENV)/.installed-core: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 -e .
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# one resolution for everything (about 25 s quicker than one pip run per group), with
	# torch pinned on the same line: 2.13.0 is the CPU build on this machine's disk (never a
	# CUDA download), so pip never swaps it; TensorFlow (extra `tensorflow`) and Spark (extra
	# `spark`; pyspark 4 needs Java 17) pinned too
	$(PIP) install -q torch==2.13.0 -r requirements.txt tensorflow-cpu==2.21.0 pyspark==4.3.0
	$(PIP) install -q --no-deps -e .
	# TF1 graphs' asynchronous kernel, compiled now rather than at a job's first graph
	# collective (about 7 s; without a compiler the graphs use tf.data pipelines instead)
	-$(PY) -c "from hvdlite.tensorflow.graph.async_call import main; main()" 2>&1 | tail -1
	touch $(VENV)/.installed-core $@

demo: install-core
	$(VENV)/bin/hvdlite-run -np 2 $(PY) examples/pytorch_mnist.py --epochs 2

# ruff with the rules of pyproject.toml's [tool.ruff] (pyflakes and pycodestyle's errors),
# ruff's formatter as a check (every module but [tool.ruff.format]'s exclude list), and
# mypy on the packages [tool.mypy] lists; CI runs it before the suite
lint: install
	$(VENV)/bin/ruff check hvdlite tests benchmarks examples
	$(VENV)/bin/ruff format --check hvdlite tests benchmarks examples
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format hvdlite tests benchmarks examples

# the suite but its `slow` tests (long scenarios another test covers in part, benchmark smoke
# runs, the docs build): under 20 minutes on the 2-core machine; CI runs test-slow after it
test: install
	bash tests/setup_system.sh
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider --durations=30 \
		-m "not slow and not chaos_long" tests

test-slow: install
	bash tests/setup_system.sh
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider --durations=10 \
		-m slow tests

bench: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/hvdlite-run -np 2 $(PY) benchmarks/allreduce.py

# the API reference (docs/api, Sphinx autodoc) as HTML in build/docs; a warning fails the build
docs: install
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs/api build/docs

clean:
	rm -rf $(VENV) *.egg-info
