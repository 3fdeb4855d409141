# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install only when the dependency files change (fast when already installed).
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
export JAX_PLATFORMS ?= cpu
export TPU_ACCELERATOR_TYPE ?= v5litepod-1
export TPU_WORKER_HOSTNAMES ?= localhost

.PHONY: demo test test-slow install bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,aot,demo,ray,tune,diffusers]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# torch-tpu's wheel (TPU hosts only): tests load its pure-Python pallas.py with the native modules stubbed.
TORCH_TPU_WHEEL := $(VENV)/torch_tpu_wheel/.torch-tpu-0.2.0
$(TORCH_TPU_WHEEL): $(STAMP)
	$(PY) -m pip download -q --no-deps torch-tpu==0.2.0 -d $(VENV)/torch_tpu_wheel
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tpukernels demo

test: $(STAMP) $(TORCH_TPU_WHEEL)
	$(PY) -m pytest -n 2 -q

# Every library kernel vs XLA and public Pallas kernels (libtpu model) + host costs -> BENCHMARKS.md
bench: $(STAMP)
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(VENV)/bin/tpukernels bench --chips v5e,v6e,tpu7x \
		--results-dir benchmarks/results --out BENCHMARKS.md --readme README.md

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
