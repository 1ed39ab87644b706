# `make module`: the Mesos isolator module (mesos/), built against MESOS_HOME's headers and libmesos with
# the toolchain that Mesos was built with (../shared/mesos/README.md: gcc 12, Debian's protobuf 3.21,
# gRPC 1.51, glog 0.6, boost 1.74). The stubs are generated here, from proto/, by Debian's protoc and
# grpc_cpp_plugin: the proto stays the one contract. An agent loads a module only of its own Mesos
# version, so each version gets its own build/mesos-<version>/; build/libgpu_isolator_module.so is
# the one for MESOS_HOME (default: what ../shared/mesos/setup.sh --dev prints).
MODULE_MESOS_HOME := $(or $(MESOS_HOME),$(shell [ -x ../shared/mesos/setup.sh ] && ../shared/mesos/setup.sh --dev 2>/dev/null | tail -1))
MODULE_MESOS_VERSION := $(patsubst libmesos-%.so,%,$(notdir $(wildcard $(MODULE_MESOS_HOME)/lib/libmesos-*.so)))
MODULE_DIR := build/mesos-$(MODULE_MESOS_VERSION)
MODULE_SO := $(MODULE_DIR)/libgpu_isolator_module.so
MODULE_GEN := $(MODULE_DIR)/gen
MODULE_PROTO := proto/gpuisolator/v1/isolator.proto
MODULE_WIRE_PROTO := proto/gpuisolator/v1/wire.proto
# The pure pieces (parameters, translation, retry decisions) are their own sources, so that
# `make module-test` links them into a gtest binary without the agent.
MODULE_PURE_SRCS := mesos/settings.cpp mesos/translate.cpp mesos/retry.cpp
MODULE_SRCS := mesos/gpu_isolator.cpp mesos/runtime.cpp mesos/module.cpp $(MODULE_PURE_SRCS)
MODULE_HDRS := mesos/gpu_isolator.hpp mesos/runtime.hpp mesos/settings.hpp mesos/translate.hpp mesos/retry.hpp
MODULE_TEST_SRCS := $(wildcard mesos/tests/*.cpp)
# libmesos links gRPC's `_unsecure` flavour: a module linking the other one (libgrpc++, libgrpc) puts two
# gRPC cores in the agent, and the second one's initialisation never returns (seen: the agent hangs in
# grpc_tracer_init right after loading the module). So the same flavour, and `--no-undefined`.
# Mesos builds with -std=c++14 semantics on gcc 12 (its headers need nothing newer); the warnings are ours.
CXXFLAGS_MODULE := -std=c++14 -O2 -g -fPIC -Wall -Wextra -Werror -Wno-unused-parameter -Wno-deprecated-declarations \
	-DPICOJSON_USE_INT64 -D__STDC_FORMAT_MACROS -isystem $(MODULE_MESOS_HOME)/include -I$(MODULE_GEN) -Imesos
LDFLAGS_MODULE := -shared -Wl,--no-undefined -Wl,-rpath,$(MODULE_MESOS_HOME)/lib -L$(MODULE_MESOS_HOME)/lib -lmesos \
	$(shell pkg-config --libs grpc++_unsecure protobuf 2>/dev/null) -lglog -lpthread

# What compiling against the headers needs beyond `setup.sh --dev`: stout/net.hpp includes <curl/curl.h>.
# A build does not change the host unasked: without them it names them and stops. With
# MODULE_INSTALL_DEPS=1 it installs those packages only (apt-get may have to upgrade what they depend
# on at the same version, e.g. libcurl4 and curl for libcurl4-openssl-dev), prints apt-get's plan
# first and says what it installed.
MODULE_BUILD_DEPS ?= libcurl4-openssl-dev
MODULE_INSTALL_DEPS ?=

.PHONY: module module-deps
# $(call need_debs,TARGET,PACKAGES): a build target names the Debian packages it misses and stops;
# with MODULE_INSTALL_DEPS=1 it installs only those, printing apt-get's plan first and what it installed.
need_debs = missing=""; for p in $(2); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$(MODULE_INSTALL_DEPS)" != 1 ]; then \
		echo "make $(1): needs the Debian package(s)$$missing (not installed). Install them, e.g." \
			"apt-get install --no-install-recommends$$missing, or run again with MODULE_INSTALL_DEPS=1" >&2; exit 2; fi; \
	echo "make $(1): installing$$missing (MODULE_INSTALL_DEPS=1); apt-get's plan:" >&2; \
	apt-get update -qq >&2 || exit 1; \
	apt-get install -s --no-install-recommends $$missing | sed -n 's/^Inst /  install or upgrade: /p' >&2; \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
	echo "make $(1): installed$$missing" >&2

module-deps:
	@$(call need_debs,module,$(MODULE_BUILD_DEPS))

module: $(MODULE_SO)
	@[ -n "$(MODULE_MESOS_VERSION)" ] || { echo "make module: no Mesos at MESOS_HOME='$(MODULE_MESOS_HOME)'" >&2; exit 1; }
	@# Renamed into place: an agent loading the copy never reads half of it.
	@mkdir -p build && cp -f $(MODULE_SO) build/.libgpu_isolator_module.so.$$$$ && \
		mv -f build/.libgpu_isolator_module.so.$$$$ build/libgpu_isolator_module.so
	@echo "built $(MODULE_SO) for Mesos $(MODULE_MESOS_VERSION) (and build/libgpu_isolator_module.so)"

# `make module-install MODULE_DEST=DIR`: the module for MESOS_HOME's version, built if needed and installed
# as DIR/libgpu_isolator_module.so from that version's own build/mesos-<version>/. Not from the copy at
# build/libgpu_isolator_module.so, which is whichever version's `make module` ran last: two versions
# built from one checkout at once (CI's test-mesos runs) made an agent load the other's and abort.
MODULE_DEST ?=
.PHONY: module-install
module-install: module
	@[ -n "$(MODULE_DEST)" ] || { echo "make module-install: say where it goes: MODULE_DEST=DIR" >&2; exit 2; }
	install -D -m 0755 $(MODULE_SO) "$(MODULE_DEST)/libgpu_isolator_module.so"
	@echo "installed $(MODULE_DEST)/libgpu_isolator_module.so for Mesos $(MODULE_MESOS_VERSION)"

# wire.proto (the metadata keys' and the bridge framing's names) has no service: messages only.
$(MODULE_GEN)/gpuisolator/v1/isolator.grpc.pb.cc: $(MODULE_PROTO) $(MODULE_WIRE_PROTO)
	@[ -n "$(MODULE_MESOS_VERSION)" ] || { echo "make module: no Mesos at MESOS_HOME='$(MODULE_MESOS_HOME)'" >&2; exit 1; }
	@mkdir -p $(MODULE_GEN)
	protoc -Iproto --cpp_out=$(MODULE_GEN) --grpc_out=$(MODULE_GEN) \
		--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) $(MODULE_PROTO)
	protoc -Iproto --cpp_out=$(MODULE_GEN) $(MODULE_WIRE_PROTO)

MODULE_GEN_OBJS := $(MODULE_DIR)/isolator.pb.o $(MODULE_DIR)/isolator.grpc.pb.o $(MODULE_DIR)/wire.pb.o
MODULE_OBJS := $(patsubst mesos/%.cpp,$(MODULE_DIR)/%.o,$(MODULE_SRCS)) $(MODULE_GEN_OBJS)
MODULE_PURE_OBJS := $(patsubst mesos/%.cpp,$(MODULE_DIR)/%.o,$(MODULE_PURE_SRCS)) $(MODULE_GEN_OBJS)

$(MODULE_GEN)/gpuisolator/v1/isolator.pb.cc $(MODULE_GEN)/gpuisolator/v1/wire.pb.cc: $(MODULE_GEN)/gpuisolator/v1/isolator.grpc.pb.cc

$(MODULE_DIR)/%.o: mesos/%.cpp $(MODULE_HDRS) $(MODULE_GEN)/gpuisolator/v1/isolator.grpc.pb.cc mesos/module.mk | module-deps
	g++ $(CXXFLAGS_MODULE) -c -o $@ $<

$(MODULE_DIR)/%.o: $(MODULE_GEN)/gpuisolator/v1/%.cc
	g++ $(CXXFLAGS_MODULE) -c -o $@ $<

$(MODULE_SO): $(MODULE_OBJS) mesos/module.mk
	g++ -o $@ $(MODULE_OBJS) $(LDFLAGS_MODULE)
	@if ldd $@ | grep -qE 'libgrpc(\+\+)?\.so'; then echo "$@ links the secure gRPC; libmesos has the _unsecure one" >&2; rm -f $@; exit 1; fi

# `make module-test`: gtest unit tests of the module's pure pieces (mesos/tests/), run without an
# agent, against MESOS_HOME's headers and libmesos. Mesos installs no gtest of its own (only its
# helpers, stout/gtest.hpp), so Debian's libgtest-dev provides it (static libgtest.a, gtest 1.12).
MODULE_TEST_DEPS := libgtest-dev
MODULE_TEST_BIN := $(MODULE_DIR)/gpu_isolator_module_tests

.PHONY: module-test module-test-deps
module-test-deps:
	@$(call need_debs,module-test,$(MODULE_TEST_DEPS))

module-test: $(MODULE_TEST_BIN)
	LD_LIBRARY_PATH=$(MODULE_MESOS_HOME)/lib $(MODULE_TEST_BIN)

$(MODULE_DIR)/tests/%.o: mesos/tests/%.cpp $(MODULE_HDRS) $(MODULE_GEN)/gpuisolator/v1/isolator.grpc.pb.cc mesos/module.mk | module-deps module-test-deps
	@mkdir -p $(MODULE_DIR)/tests
	g++ $(CXXFLAGS_MODULE) -c -o $@ $<

$(MODULE_TEST_BIN): $(patsubst mesos/tests/%.cpp,$(MODULE_DIR)/tests/%.o,$(MODULE_TEST_SRCS)) $(MODULE_PURE_OBJS) mesos/module.mk
	g++ -o $@ $(filter %.o,$^) -lgtest_main -lgtest \
		$(filter-out -shared,$(LDFLAGS_MODULE))
