# vkpool: `make demo` sets everything up and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The tests export models with torch (CPU is enough). pip takes torch==2.13.0 from the package
# index or a local wheel (find-links); where that would be the CUDA build, point pip at torch's
# CPU-only wheels: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: help demo test serve conformance realworld bench system-deps venv clean

help:
	@echo "make demo         set up (Vulkan packages, .venv) and run the demo"
	@echo "make test         set up and run the test suite on the local Vulkan device"
	@echo "make serve        run the daemon in the foreground on the default config"
	@echo "make conformance  run every ONNX backend node test, write docs/conformance.md"
	@echo "make realworld    run models nobody here wrote against onnxruntime, table into docs/conformance.md"
	@echo "make bench        run the benchmarks (BENCH_ARGS=... to pass options)"

system-deps:
	@bash scripts/ensure-vulkan.sh

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@touch $(STAMP)

venv: system-deps $(STAMP)

demo: venv
	$(PY) -m vkpool.demo

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

serve: venv
	$(VENV)/bin/vkpool serve

conformance: venv
	$(PY) -m vkpool.conformance --output docs/conformance.md

realworld: venv
	$(PY) -m bench.realworld --doc docs/conformance.md

bench: venv
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
