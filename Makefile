# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install only when the dependency files change (fast when already installed).
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
export JAX_PLATFORMS ?= cpu
export TPU_ACCELERATOR_TYPE ?= v5litepod-1
export TPU_WORKER_HOSTNAMES ?= localhost

.PHONY: demo test test-slow install bench clean torchtitan vllm docs browser

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

# vLLM-TPU's tpu-inference (its RPA v3 kernel, reference and attention-backend registry) and the vllm modules it
# imports, and torchax, all --no-deps (their pins: jax 0.11, libtpu 0.0.48, flax, ... conflict with the tested set):
# tests/test_vllm_tpu.py runs tpu-inference's own reference on CPU; tests/test_torchax_ops.py the torchax
# lowering (torchax 0.0.13 imports on torch 2.13 through tpukernels.integrations.torchax_ops' shim).
VLLM_TPU := $(VENV)/.vllm-tpu-0.32.0-torchax-0.0.13
$(VLLM_TPU): $(STAMP)
	$(PY) -m pip install -q --no-deps -c constraints.txt tpu-inference==0.32.0 vllm==0.32.0 torchax==0.0.13
	@touch $@

# torchtitan 0.3.0 (tpukernels.integrations.torchtitan) with --no-deps: its own requirements pull CUDA-only and
# heavy packages (triton via torch nightlies, datasets, tensorboard, wandb); the CPU shims in
# tpukernels/integrations/torchtitan_compat.py stand in for what it imports but does not need here.
TORCHTITAN := $(VENV)/.torchtitan-$(shell grep -E '^(torchtitan|spmd-types|tyro|docstring-parser|typeguard|torchdata)==' constraints.txt | sha1sum | cut -c1-12)
$(TORCHTITAN): $(STAMP)
	$(PY) -m pip install -q --no-deps -c constraints.txt torchtitan spmd-types tyro docstring-parser typeguard torchdata
	@rm -f $(VENV)/.torchtitan-*
	@touch $@

torchtitan: $(TORCHTITAN)

# flash-linear-attention (fla-core) --no-deps for its naive torch references of GDN / KDA (tests load
# fla/ops/*/naive.py by path: the package's __init__ imports triton) and einops, which those files import.
FLA := $(VENV)/.fla-core-0.6.0-einops-0.8.2
$(FLA): $(STAMP)
	$(PY) -m pip install -q --no-deps -c constraints.txt fla-core==0.6.0 einops==0.8.2
	@touch $@

# tokamax --no-deps for the measured TPU times its wheel ships (data/autotuning/<chip>/*.json), which the
# calibration bench family (tpukernels/bench/calibration.py) models; its own requirements (immutabledict,
# jaxtyping, qwix, ...) are not needed: the calibration loads only the data files and the splash-attention modules.
TOKAMAX := $(VENV)/.tokamax-0.0.12
$(TOKAMAX): $(STAMP)
	$(PY) -m pip install -q --no-deps -c constraints.txt tokamax==0.0.12
	@touch $@

# The documentation site's packages (the docs extra, pinned in constraints.txt), reinstalled when their pins change.
DOCS := $(VENV)/.docs-$(shell grep -iE '^(mkdocs|mkdocs-material|mkdocs-material-extensions|mkdocstrings|mkdocstrings-python|mkdocs-autorefs|griffelib|pymdown-extensions|markdown)==' constraints.txt | sha1sum | cut -c1-12)
$(DOCS): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	@rm -f $(VENV)/.docs-*
	@touch $@

# The site, strict (a broken link, a missing reference or a docstring that fails to render fails): site/index.html
docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Headless Chromium for tests/test_docs.py's browser check: Debian's package, installed when missing and root;
# otherwise (or if apt fails) that one test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; } || \
	  echo "make: chromium not installed (needs root and apt-get): tests/test_docs.py skips its browser check"; }

# the CPU test set of the vLLM-TPU backend (tpu-inference, vllm, torchax --no-deps into .venv); a TPU host: docs/guides/serving.md
vllm: $(VLLM_TPU)

install: $(STAMP)

demo: $(STAMP)
	@echo "make demo: starting tpukernels demo (importing torch + jax takes a few seconds; about half a minute on 2 cores; later runs reuse cached libtpu estimates)"
	$(VENV)/bin/tpukernels demo

# A test whose xdist worker dies is rerun once on a fresh worker (pytest-rerunfailures); -rR names it in the
# summary ("RERUN"). Why: about once or twice per full run (a different test each time, never alone) a worker
# dies of a SIGSEGV at one instruction of libgcc_s's unwinder; the stacks faulthandler caught were inside jax's
# XLA:CPU compile (backend_compile_and_load). Once, before dying, the worker failed five tests with MemoryError /
# SystemError out of MLIR calls (15+ GiB free): tests/sick_worker.py makes such a worker exit at once, so that test
# reruns on a fresh worker too. An ordinary failure is never rerun: --rerun-except . matches every exception, so
# it fails at once. --max-suite-reruns caps the reruns of a whole run. The torchax-marked modules run in a second
# pytest run: after such a crash xdist requeues the dead worker's items behind them, and a process that has
# imported torchax can no longer torch.compile (tests/conftest.py, TORCHAX_MODULES).
test: $(STAMP) $(TORCH_TPU_WHEEL) $(VLLM_TPU) $(TORCHTITAN) $(FLA) $(TOKAMAX) $(DOCS) browser
	$(PY) -m pytest -n 2 -q -rR --durations=30 --reruns 1 --rerun-except . --max-suite-reruns 4 -m "not slow and not torchax"
	$(PY) -m pytest -n 2 -q -rR --durations=5 --reruns 1 --rerun-except . --max-suite-reruns 2 -m "torchax and not slow"

# Every library kernel vs XLA and public Pallas kernels (libtpu model) + host costs -> BENCHMARKS.md
bench: $(STAMP) $(TOKAMAX)
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(VENV)/bin/tpukernels bench --chips v5e,v6e,tpu7x \
		--results-dir benchmarks/results --out BENCHMARKS.md --readme README.md

test-slow: $(STAMP) $(TORCHTITAN) $(FLA) $(VLLM_TPU) $(TORCH_TPU_WHEEL) $(TOKAMAX)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
