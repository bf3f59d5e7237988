# Thin wrapper over deploy/setup.sh, CMake, ctest and pytest. The README's two commands: `make run`, `make test`.
BUILD    ?= build
ASAN     ?= build-asan
FUZZ     ?= build-fuzz
NEON     ?= build-neon
JOBS     ?= $(shell nproc)
VENV     := .venv
PYTEST   := $(VENV)/bin/python -m pytest

.PHONY: all setup build build-asan build-fuzz build-neon run test test-unit test-asan test-fuzz test-neon test-integration \
        test-skips bench clean gpu-carry \
        image test-image

all: build

setup:
	@deploy/setup.sh

build: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

build-asan: setup
	@cmake -S . -B $(ASAN) -DCMAKE_BUILD_TYPE=Debug -DBATON_SANITIZE=address,undefined >/dev/null
	@cmake --build $(ASAN) -j $(JOBS)

build-fuzz: setup
	@cmake -S . -B $(FUZZ) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DBATON_FUZZ=ON -DBATON_TESTS=OFF >/dev/null
	@cmake --build $(FUZZ) -j $(JOBS)

# The engine cross-built for aarch64 (Debian's gcc-aarch64-linux-gnu): its unit tests run under qemu-aarch64 and
# check the NEON kernels bit for bit against the scalar references (cmake/aarch64-linux-gnu.cmake).
build-neon: setup
	@cmake -S . -B $(NEON) -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/cmake/aarch64-linux-gnu.cmake -DBATON_ENGINE_ONLY=ON \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(NEON) -j $(JOBS)

# Each suite writes JUnit XML; tests/skip_report.py lists every skip from them, and with SKIP_ALLOW=FILE (.ci/run
# passes tests/allowed-skips.txt) fails on a skip that the file does not allow.
REPORTS  := unit=$(CURDIR)/$(BUILD)/ctest-junit.xml asan=$(CURDIR)/$(ASAN)/ctest-junit.xml \
            fuzz=$(CURDIR)/$(FUZZ)/ctest-junit.xml neon=$(CURDIR)/$(NEON)/ctest-junit.xml integration=$(CURDIR)/$(BUILD)/pytest-junit.xml
SKIP_ALLOW ?=

# Every test: unit tests (release and ASan+UBSan builds), short fuzz runs, the aarch64 engine tests under qemu, the
# integration suite, then the skips.
test: build build-asan build-fuzz build-neon
	@rm -f $(foreach r,$(REPORTS),$(lastword $(subst =, ,$(r))))
	@$(MAKE) --no-print-directory test-unit test-asan test-fuzz test-neon test-integration
	@$(MAKE) --no-print-directory test-skips
	@echo "make test: all suites passed"

test-unit:
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --output-junit $(CURDIR)/$(BUILD)/ctest-junit.xml
	@cat $(BUILD)/cuda-tests-not-run.txt 2>/dev/null || true

test-asan:
	@cd $(ASAN) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) --output-junit $(CURDIR)/$(ASAN)/ctest-junit.xml

test-fuzz:
	@cd $(FUZZ) && ctest --output-on-failure -j $(JOBS) --output-junit $(CURDIR)/$(FUZZ)/ctest-junit.xml

# BATON_REQUIRE_ISA=neon,neon-i8mm: qemu's default CPU model (max) has the dot product and i8mm, so a NEON entry that
# skips is a failure.
# test_sampler (no kernels; 3.5 minutes under qemu) runs in the native suites only.
test-neon:
	@cd $(NEON) && BATON_REQUIRE_ISA=neon,neon-i8mm ctest --output-on-failure -j $(JOBS) -E '^test_sampler$$' \
	  --output-junit $(CURDIR)/$(NEON)/ctest-junit.xml

test-integration:
	@BATON_BUILD_DIR=$(CURDIR)/$(BUILD) $(PYTEST) -q -rs tests/integration --junitxml=$(CURDIR)/$(BUILD)/pytest-junit.xml

test-skips:
	@python3 tests/skip_report.py $(if $(SKIP_ALLOW),--allow $(SKIP_ALLOW)) $(REPORTS)

# The CPU image (deploy/Dockerfile) built with podman on locally bootstrapped Debian 12 bases, then its programs run
# from the image's root file system (tests/image explains why not in a container). Not part of `make test`: needs
# podman and debootstrap, and a few minutes.
image:
	@deploy/image/build-local.sh

test-image: build image
	@BATON_BUILD_DIR=$(CURDIR)/$(BUILD) $(PYTEST) -q -rs tests/image

run: build
	@deploy/local/cluster up

bench: build
	@$(BUILD)/bin/baton bench

clean:
	rm -rf $(BUILD) $(ASAN) $(FUZZ) $(NEON)

# The folder tools/gpu-check.sh runs from on a lent GPU machine (README "CUDA backend"): build-cuda/.
gpu-carry: build
	@tools/gpu-check-prepare.sh $(BUILD) build-cuda
