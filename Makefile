# vkpool: `make demo` sets everything up and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# `make demo` installs the engine alone; `make test` and `make bench` add their extras
# (pyproject.toml). Each stamp is remade when pyproject.toml changes.
ENGINE := $(VENV)/.installed
EXTRAS  = $(VENV)/.installed-$(1)
comma  := ,
# setuptools explains every editable install of a package-dir layout in ten lines: nothing to act on
PIP     = PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip
# The tests export models with torch (CPU is enough). pip takes torch==2.13.0 from the package
# index or a local wheel (find-links); where that would be the CUDA build, point pip at torch's
# CPU-only wheels: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: help demo test serve conformance realworld bench system-deps venv clean

help:
	@echo "make demo         set up (Vulkan packages, .venv with the engine) and run the demo"
	@echo "make test         add the test and benchmark tools to .venv and run the suite on the local Vulkan device"
	@echo "make serve        run the daemon in the foreground on the default config"
	@echo "make conformance  run every ONNX backend node test, write docs/conformance.md"
	@echo "make realworld    run models nobody here wrote against onnxruntime, table into docs/conformance.md"
	@echo "make bench        add the benchmark tools to .venv and run the benchmarks (BENCH_ARGS=...)"

system-deps:
	@bash scripts/ensure-vulkan.sh

$(ENGINE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.installed-%: $(ENGINE)
	$(PIP) install -q -e '.[$(subst +,$(comma),$*)]' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@touch $@

venv: system-deps $(ENGINE)

demo: venv
	$(PY) -m vkpool.demo
	@echo "next: '. $(VENV)/bin/activate' puts the vkpool command on PATH; then vkpool devices (README.md, Use)"

# the suite tests the benchmark runners too (ncnn through pnnx, the plots) and a local Ray cluster
# (vkpool.cluster): it takes the bench and cluster extras
test: system-deps $(call EXTRAS,test+bench+cluster)
	$(PY) -m pytest -q -p no:cacheprovider

serve: venv
	$(VENV)/bin/vkpool serve

conformance: venv
	$(PY) -m vkpool.conformance --output docs/conformance.md

realworld: system-deps $(call EXTRAS,test)
	$(PY) -m bench.realworld --doc docs/conformance.md

bench: system-deps $(call EXTRAS,test+bench)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
