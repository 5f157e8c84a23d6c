# qtrain - build, test, install, benchmark.
#
# Layout: base/ nn/ quant/ lora/ data/ trainer/ are the library (libqtrain.a;
# include/qtrain.h is its one public header, trainer/api.c implements it);
# cli/ is what only the qtrain command runs (main.c, compare's table and
# chart, demo, bench), linked into build/qtrain and the test runner only.
#
#   make            libqtrain.a and the qtrain binary (build/); needs no CUnit
#   make shared     build/libqtrain.so.MAJOR.MINOR.PATCH (soname libqtrain.so.MAJOR) from
#                   -fPIC objects in build/pic/
#   make examples   examples/*.c against build/libqtrain.a, into build/examples/
#   make install    PREFIX=/usr/local (and DESTDIR=): bin/qtrain, lib/libqtrain.a,
#                   lib/libqtrain.so*, include/qtrain.h, lib/pkgconfig/qtrain.pc (docs/LIBRARY.md)
#   make uninstall  the same PREFIX and DESTDIR: removes exactly those files (directories
#                   stay: /usr/local/lib may be empty and still be the system's)
#   make deps       install the Debian packages qtrain needs, if missing
#   make test       build and run the CUnit suites (installs deps and CUnit first)
#   make test SANITIZE=1   the same under AddressSanitizer + UBSan
#   make CLONES=avx2   build/avx2/qtrain without the AVX-512 copies of the elementwise loops (an
#                   AVX2-only CPU's code on an AVX-512 one: capped benchmarks, bench/README.md; tests)
#   make run        pretrain the CNN on Fashion-MNIST end to end (installs deps first)
#   make bench      benchmarks (timings live here, never in tests): bench/*.c and
#                   qtrain bench on every bench/configs/*.yaml (bench/run.sh)
#   make bench-torch  the bench/configs measurements in qtrain, then in PyTorch
#                   (Debian's python3-torch, installed if missing), side by side
#   make bench-export  the CNN exported as C (qtrain export --format c) against qtrain's
#                   int8 paths and PyTorch's int8 (if installed), one core each
#                   (bench/export_bench.sh); make bench runs it last
#   make fixtures   regenerate the PyTorch reference fixtures in tests/fixtures/ (needs torch)
#   make fuzz       the libFuzzer targets (clang), FUZZ_SECONDS each (fuzz/README.md)
#   make MPI=1      also build/qtrain-mpi: data-parallel training under Open MPI's mpirun
#                   (installs libopenmpi-dev and openmpi-bin if missing; docs/DISTRIBUTED.md)
#   make test MPI=1 the tests with the Open MPI suite; plain `make test` runs it when Open MPI is
#                   installed and reports it skipped otherwise
#   make bench-mpi  1 process x 2 threads against 2 ranks x 1 thread, the sum's latency and
#                   bandwidth at the reference models' gradient sizes (build/bench/allreduce_bench),
#                   and a scaling model for N machines on 10/25 Gb/s (bench/mpi_bench.sh)
#   make memcheck   tiny end-to-end runs under valgrind's memcheck (Debian's valgrind, installed
#                   if missing): fails on any memory error or leak (scripts/memcheck.sh)

PKGS    := openblas hdf5 yaml-0.1 zlib
CFLAGS  ?= -O2
# -O2 plus loop vectorisation that pays for its epilogue (GCC's -O2 default
# model vectorises almost none of the elementwise loops), and no errno from
# libm, so sqrtf/expf loops can vectorise. No -ffast-math: IEEE results stay.
CFLAGS  += -fvect-cost-model=cheap -fno-math-errno
CFLAGS  += -std=gnu11 -Wall -Wextra -g -I. -MMD -MP
# LAPACKE (liblapacke-dev) for LoRA's SVD initialisations (lora/lora_svd.c); Debian's lapacke.pc when present
LAPACKE_LIBS = $(shell pkg-config --libs lapacke 2>/dev/null || echo -llapacke)
LDLIBS  = $(LAPACKE_LIBS) -lm -lpthread

BUILD := build
ifeq ($(SANITIZE),1)
BUILD   := build/san
CFLAGS  += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS += -fsanitize=address,undefined
endif
# CLONES=avx2: gcc's per-ISA copies of the elementwise loops without their AVX-512 copy (nn/ops.h), in
# build/avx2/ (build/san/avx2/ with SANITIZE=1): with the QTRAIN_*_KERNEL caps, what an AVX2-only CPU runs
# (bench/README.md); .ci/run tests that copy under the sanitizers
ifeq ($(CLONES),avx2)
BUILD   := $(BUILD)/avx2
CFLAGS  += -DQTRAIN_NO_AVX512_CLONES
endif

# pkg-config is only asked when something is compiled, so `make deps` works
# on a machine that has none of the packages yet.
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CUNIT_CFLAGS = $(shell pkg-config --cflags cunit 2>/dev/null)
CUNIT_LIBS   = $(shell pkg-config --libs cunit 2>/dev/null)

LIB_SRCS   := $(wildcard base/*.c nn/*.c quant/*.c lora/*.c data/*.c device/*.c trainer/*.c)
# The device runtime's text, embedded for `qtrain export --format c` (scripts/embed.sh).
RT_EMBED   := device/qtrain_rt.h device/qtrain_rt.c
LIB_OBJS   := $(LIB_SRCS:%.c=$(BUILD)/%.o) $(BUILD)/gen/rt_source.o
# The commands' code beside main.c: in the binary and the test runner, never in the library.
CLI_SRCS   := $(filter-out cli/main.c,$(wildcard cli/*.c))
CLI_OBJS   := $(CLI_SRCS:%.c=$(BUILD)/%.o)
TEST_SRCS  := $(wildcard tests/*.c)
TEST_OBJS  := $(TEST_SRCS:%.c=$(BUILD)/%.o)
# export_timing.c is built against an export's directory by bench/export_bench.sh, not with the library;
# allreduce_bench.c needs MPI (the MPI section below, make bench-mpi), so plain make bench never does.
BENCH_SRCS := $(filter-out bench/export_timing.c bench/allreduce_bench.c,$(wildcard bench/*.c))
BENCH_BINS := $(BENCH_SRCS:bench/%.c=$(BUILD)/bench/%)

LIB    := $(BUILD)/libqtrain.a
QTRAIN := $(BUILD)/qtrain
QTRAIN_MPI := $(BUILD)/qtrain-mpi
TESTS  := $(BUILD)/tests/run_tests

# The shared library: the version is include/qtrain.h's QTRAIN_VERSION_MAJOR/MINOR/PATCH.
version_part = $(shell sed -n 's/^\#define QTRAIN_VERSION_$(1)  *\([0-9][0-9]*\).*/\1/p' include/qtrain.h 2>/dev/null)
VERSION_MAJOR = $(call version_part,MAJOR)
VERSION       = $(VERSION_MAJOR).$(call version_part,MINOR).$(call version_part,PATCH)
PIC_BUILD := $(BUILD)/pic
PIC_OBJS  := $(LIB_SRCS:%.c=$(PIC_BUILD)/%.o) $(PIC_BUILD)/gen/rt_source.o
SONAME    = libqtrain.so.$(VERSION_MAJOR)
SHLIB     = $(BUILD)/libqtrain.so.$(VERSION)

PREFIX     ?= /usr/local
BINDIR     := $(PREFIX)/bin
LIBDIR     := $(PREFIX)/lib
INCLUDEDIR := $(PREFIX)/include
PCDIR      := $(LIBDIR)/pkgconfig

DEB_PKGS  := libopenblas-dev liblapacke-dev libhdf5-dev libyaml-dev zlib1g-dev pkg-config dataset-fashion-mnist
TEST_DEBS := libcunit1-dev python3-h5py python3-numpy python3-pil gcc-aarch64-linux-gnu libc6-dev-arm64-cross gcc-arm-linux-gnueabihf libc6-dev-armhf-cross gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-user
APT_ENV   := env DEBIAN_FRONTEND=noninteractive

.PHONY: mpi mpi-deps bench-mpi compare research all deps test-deps pkgcheck pkgcheck-cunit test run bench bench-torch bench-export torch-deps fixtures interop memcheck \
	clean hostile-corpus shared examples install uninstall
all: $(LIB) $(QTRAIN) $(if $(filter 1,$(MPI)),mpi)

# $(call apt_install,PACKAGES): installs those of PACKAGES that are missing.
define apt_install
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  if [ "$$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi; \
	  $$sudo apt-get update -qq && $$sudo $(APT_ENV) apt-get install -y -qq --no-install-recommends $$missing; \
	fi
endef

deps:
	$(call apt_install,$(DEB_PKGS))

# CUnit: only the test runner needs it.
test-deps: deps
	$(call apt_install,$(TEST_DEBS))

# QT's vector kernels, the batch norm's (whose backward makes the forward's output again for a relu's mask) and
# F(2x2, 3x3)'s (whose weight-gradient transform halves sums and adds them) are bit-exact twins of scalar loops:
# no a * b + c contracted into one FMA in those loops (which a CFLAGS=-march with FMA, or a target("fma")
# function's vector operations, would otherwise allow), in every build directory; and the test that holds the
# batch norm's sums to their definition.
%/quant/fqt.o %/quant/fqt_kern.o %/quant/fqt_kern_x86.o %/quant/fqt_backward.o %/nn/ops_bn_kernels.o \
%/nn/conv_wino.o %/nn/conv_wino_x86.o %/tests/test_conv_bn.o: CFLAGS += -ffp-contract=off

# gcc 12's partial redundancy elimination leaves the AVX2 taps kernel a register copy per accumulator every tap,
# and spills when its 12 accumulators fill the registers (docs/BENCHMARKS.md, "Int8 on AVX2"); the file's other
# loops do not need it.
%/quant/qgemm_avx2.o: CFLAGS += -fno-tree-pre

$(BUILD)/%.o: %.c | pkgcheck
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(PKG_CFLAGS) -c $< -o $@

$(BUILD)/tests/%.o: tests/%.c | pkgcheck pkgcheck-cunit
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(PKG_CFLAGS) $(CUNIT_CFLAGS) -c $< -o $@

$(BUILD)/gen/rt_source.c: $(RT_EMBED) scripts/embed.sh
	@mkdir -p $(dir $@)
	sh scripts/embed.sh $@ export_rt_h device/qtrain_rt.h export_rt_c device/qtrain_rt.c

$(BUILD)/gen/rt_source.o: $(BUILD)/gen/rt_source.c
	$(CC) $(CFLAGS) -c $< -o $@

$(PIC_BUILD)/gen/rt_source.o: $(BUILD)/gen/rt_source.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC -c $< -o $@

# The shared library's objects: the same sources, position-independent.
$(PIC_BUILD)/%.o: %.c | pkgcheck
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC $(PKG_CFLAGS) -c $< -o $@

# A missing .pc file would otherwise empty every flag and surface as a
# puzzling "cblas.h: No such file". The message names each missing
# pkg-config module with the Debian package that brings it.
deb_of = openblas:libopenblas-dev hdf5:libhdf5-dev yaml-0.1:libyaml-dev zlib:zlib1g-dev cunit:libcunit1-dev
define pkg_exists
	@missing=""; for p in $(1); do pkg-config --exists $$p 2>/dev/null || missing="$$missing $$p"; done; \
	[ -z "$$missing" ] || { debs=""; for p in $$missing; do for m in $(deb_of); do \
	  [ "$${m%%:*}" = "$$p" ] && debs="$$debs $${m#*:}"; done; done; \
	  echo "missing development packages: pkg-config cannot find$$missing (Debian:$$debs); run" \
	  "'make $(2)' (as root) to install them, or point PKG_CONFIG_PATH at their .pc files" >&2; exit 1; }
endef
pkgcheck:
	$(call pkg_exists,$(PKGS),deps)
pkgcheck-cunit:
	$(call pkg_exists,cunit,test-deps)

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(QTRAIN): $(BUILD)/cli/main.o $(CLI_OBJS) $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(PKG_LIBS) $(LDLIBS)

# A suite file whose register_NAME_suite main.c does not list would never run.
$(TESTS): $(TEST_OBJS) $(CLI_OBJS) $(LIB)
	@for s in $$(sed -n 's/^int register_\([a-z0-9_]*\)_suite(void).*/\1/p' $(TEST_SRCS)); do \
	  grep -q "X($$s)" tests/main.c || { echo "tests: register_$${s}_suite is not listed in tests/main.c's" \
	  "SUITES; add X($$s) there" >&2; exit 1; }; done
	$(CC) $(LDFLAGS) $^ -o $@ $(PKG_LIBS) $(CUNIT_LIBS) $(LDLIBS)

shared: $(SHLIB)

# examples/*.c against the library in the tree (installed: docs/LIBRARY.md).
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
examples: $(EXAMPLES)
$(BUILD)/examples/%: examples/%.c include/qtrain.h $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Iinclude $< -o $@ $(LDFLAGS) $(LIB) $(PKG_LIBS) $(LDLIBS)

# Linked against its dependencies, so a program linking -lqtrain alone loads
# them; exports only qtrain_* (include/qtrain.h), the internals stay local.
$(SHLIB): $(PIC_OBJS)
	printf '{ global: qtrain_*; local: *; };\n' > $(BUILD)/libqtrain.map
	$(CC) $(LDFLAGS) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=$(BUILD)/libqtrain.map $(PIC_OBJS) -o $@ \
	  $(PKG_LIBS) $(LDLIBS)

# Requires.private/Libs.private: what `pkg-config --static --libs qtrain`
# adds for linking libqtrain.a; a shared link needs only -lqtrain. Written
# straight into the destination with the command line's PREFIX: an install
# of a tree already built writes nothing under build/, so `sudo make
# install` leaves no root-owned file there to break the next build.
define pc_text
printf '%s\n' 'prefix=$(PREFIX)' 'exec_prefix=$${prefix}' 'libdir=$${prefix}/lib' \
  'includedir=$${prefix}/include' '' 'Name: qtrain' \
  'Description: quantization-aware training, QLoRA and post-training quantization of small networks on a CPU' \
  'Version: $(VERSION)' 'Requires.private: $(PKGS)' 'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lqtrain' \
  'Libs.private: $(LDLIBS)'
endef

# The tests install into a temporary PREFIX with the objects already built.
# With MPI=1 also bin/qtrain-mpi and bin/qtrain-mpirun (docs/DISTRIBUTED.md).
install: $(LIB) $(QTRAIN) $(SHLIB) $(if $(filter 1,$(MPI)),$(QTRAIN_MPI))
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PCDIR)
	install -m 755 $(QTRAIN) $(DESTDIR)$(BINDIR)/qtrain
	$(if $(filter 1,$(MPI)),install -m 755 $(QTRAIN_MPI) $(DESTDIR)$(BINDIR)/qtrain-mpi)
	$(if $(filter 1,$(MPI)),install -m 755 scripts/qtrain-mpirun $(DESTDIR)$(BINDIR)/qtrain-mpirun)
	install -m 644 $(LIB) $(DESTDIR)$(LIBDIR)/libqtrain.a
	install -m 755 $(SHLIB) $(DESTDIR)$(LIBDIR)/libqtrain.so.$(VERSION)
	ln -sf libqtrain.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libqtrain.so
	install -m 644 include/qtrain.h $(DESTDIR)$(INCLUDEDIR)/qtrain.h
	$(pc_text) > $(DESTDIR)$(PCDIR)/qtrain.pc
	chmod 644 $(DESTDIR)$(PCDIR)/qtrain.pc

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/qtrain $(DESTDIR)$(BINDIR)/qtrain-mpi $(DESTDIR)$(BINDIR)/qtrain-mpirun \
	  $(DESTDIR)$(LIBDIR)/libqtrain.a $(DESTDIR)$(LIBDIR)/libqtrain.so.$(VERSION) \
	  $(DESTDIR)$(LIBDIR)/$(SONAME) $(DESTDIR)$(LIBDIR)/libqtrain.so $(DESTDIR)$(INCLUDEDIR)/qtrain.h \
	  $(DESTDIR)$(PCDIR)/qtrain.pc

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(PKG_LIBS) $(LDLIBS)

# The device runtime's bench once more with the host's SIMD path (-march=native: AVX2 or NEON) beside
# build/bench/rt_bench, which runs the library's build of the runtime (portable on a generic x86-64).
BENCH_BINS += $(BUILD)/bench/rt_bench_native
$(BUILD)/bench/rt_bench_native: bench/rt_bench.c device/qtrain_rt.c device/qtrain_rt.h
	@mkdir -p $(dir $@)
	$(CC) -O2 -march=native -std=gnu11 -Wall -Wextra -I. bench/rt_bench.c device/qtrain_rt.c -o $@

# ---- data-parallel training on Open MPI (docs/DISTRIBUTED.md) ----------------------
# build/qtrain-mpi: cli/main.c built for MPI, with mpi/dist_mpi.c, over the same
# library; libqtrain and build/qtrain never need MPI.
MPICC      ?= mpicc
MPI_DEBS   := libopenmpi-dev openmpi-bin
# Open MPI installed: mpicc and mpirun on PATH.
have_mpi = $(shell command -v $(MPICC) >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 && echo 1)

mpi-deps: deps
	$(call apt_install,$(MPI_DEBS))

mpi: mpi-deps
	$(MAKE) --no-print-directory $(QTRAIN_MPI)

$(BUILD)/mpi/cli/main.o: cli/main.c | pkgcheck
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) $(PKG_CFLAGS) -DQTRAIN_MPI -c $< -o $@

$(BUILD)/mpi/mpi/dist_mpi.o: mpi/dist_mpi.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -c $< -o $@

$(QTRAIN_MPI): $(BUILD)/mpi/cli/main.o $(BUILD)/mpi/mpi/dist_mpi.o $(CLI_OBJS) $(LIB)
	$(MPICC) $(LDFLAGS) $^ -o $@ $(PKG_LIBS) $(LDLIBS)

# dist_sum_floats over MPI_COMM_WORLD: the sum a training step runs, timed per message size.
$(BUILD)/mpi/bench/allreduce_bench.o: bench/allreduce_bench.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -c $< -o $@

$(BUILD)/bench/allreduce_bench: $(BUILD)/mpi/bench/allreduce_bench.o $(BUILD)/mpi/mpi/dist_mpi.o $(LIB)
	@mkdir -p $(dir $@)
	$(MPICC) $(LDFLAGS) $^ -o $@ $(PKG_LIBS) $(LDLIBS)

bench-mpi: mpi
	$(MAKE) --no-print-directory $(QTRAIN) $(BUILD)/bench/allreduce_bench
	QTRAIN=./$(QTRAIN_MPI) sh bench/mpi_bench.sh

# Tests run from the repository root (they read tests/fixtures/).
# OPENBLAS_NUM_THREADS=1 keeps them deterministic and quiet on shared machines.
# With Open MPI (MPI=1 installs it) the mpi suite runs build/qtrain-mpi under mpirun.
test: test-deps $(if $(filter 1,$(MPI)),mpi-deps)
	$(MAKE) --no-print-directory $(TESTS) $(QTRAIN) $(if $(have_mpi),$(QTRAIN_MPI))
	OPENBLAS_NUM_THREADS=1 QTRAIN_BIN=./$(QTRAIN) $(if $(have_mpi),QTRAIN_MPI_BIN=./$(QTRAIN_MPI)) ./$(TESTS)

# Remakes the committed hostile files of tests/hostile/ (the hostile suite
# replays them); review and commit the result with tests/hostile/expect.txt.
hostile-corpus: test-deps
	$(MAKE) --no-print-directory $(TESTS) $(QTRAIN)
	QTRAIN_HOSTILE_WRITE=tests/hostile OPENBLAS_NUM_THREADS=1 QTRAIN_BIN=./$(QTRAIN) ./$(TESTS) hostile

# Pretrain (once) -> PTQ eval -> QLoRA fine-tune -> eval, then a table.
run: deps
	$(MAKE) --no-print-directory $(QTRAIN)
	QTRAIN=./$(QTRAIN) sh scripts/main-job.sh

# Float vs PTQ int8 / int4 / nf4 / autoquant vs QAT w4a8 on the full data, then qtrain compare.
compare: deps
	$(MAKE) --no-print-directory $(QTRAIN)
	QTRAIN=./$(QTRAIN) sh scripts/compare.sh

# QLoRA at int2 / int3 / int4, default init against LoftQ, on the full data (docs/BENCHMARKS.md).
research: deps
	$(MAKE) --no-print-directory $(QTRAIN)
	QTRAIN=./$(QTRAIN) sh scripts/research-loftq.sh

bench: deps
	$(MAKE) --no-print-directory $(BENCH_BINS) $(QTRAIN)
	@for b in $(BENCH_BINS); do ./$$b || exit 1; done
	@QTRAIN=./$(QTRAIN) sh bench/run.sh
	@$(MAKE) --no-print-directory bench-export

# The exported C against qtrain and PyTorch on one core; PyTorch's rows say
# "skipped" without python3-torch (make torch-deps installs it).
bench-export: deps
	$(MAKE) --no-print-directory $(QTRAIN)
	@QTRAIN=./$(QTRAIN) PYTHON=/usr/bin/python3 sh bench/export_bench.sh

# Debian's PyTorch (python3-torch brings numpy and yaml), for bench-torch.
torch-deps:
	@dpkg-query -W -f='$${Status}' python3-torch 2>/dev/null | grep -q "install ok installed" || { \
	  echo "deps: installing python3-torch"; \
	  if [ "$$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi; \
	  $$sudo apt-get update -qq && $$sudo $(APT_ENV) apt-get install -y -qq --no-install-recommends python3-torch; }

# qtrain's measurements, then PyTorch's on the same configs, data and
# OpenBLAS kernels, and the side-by-side table (bench/README.md).
bench-torch: deps torch-deps
	$(MAKE) --no-print-directory $(QTRAIN)
	@QTRAIN=./$(QTRAIN) PYTHON=/usr/bin/python3 sh bench/run.sh --torch

# Needs Debian's python3-torch, python3-h5py and python3-numpy.
# The interop suite with Debian's PyTorch installed: PyTorch loads qtrain's exports (safetensors, a PEFT
# adapter directory by PEFT's conventions) and reproduces qtrain's logits (docs/INTEROP.md). `make test` runs
# the same suite and skips the PyTorch checks, visibly, where python3-torch is missing.
interop: torch-deps $(BUILD)/tests/run_tests $(BUILD)/qtrain
	OPENBLAS_NUM_THREADS=1 QTRAIN_BIN=./$(BUILD)/qtrain ./$(BUILD)/tests/run_tests interop

fixtures:
	/usr/bin/python3 tests/make_fixtures.py tests/fixtures/torch_ref.h5
	/usr/bin/python3 tests/make_fixtures_bn.py tests/fixtures/torch_bn.h5
	/usr/bin/python3 tests/make_fixtures_conv.py tests/fixtures/torch_conv.h5
	/usr/bin/python3 tests/make_fixtures_graph.py tests/fixtures/torch_graph.h5
	/usr/bin/python3 tests/make_fixtures_qatbn.py tests/fixtures/torch_qatbn.h5
	/usr/bin/python3 tests/make_fixtures_dora.py tests/fixtures/torch_dora.h5

# Train, resume, eval, QLoRA, QAT, QT and the other commands on the mini data
# set under valgrind (about 75 s). Always the normal -O2 -g build (valgrind
# cannot run ASan's), so memcheck sees the code that ships. Third-party
# blocks kept by design: tests/valgrind.supp.
memcheck: deps
	@dpkg-query -W -f='$${Status}' valgrind 2>/dev/null | grep -q "install ok installed" || { \
	  echo "deps: installing valgrind"; \
	  if [ "$$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi; \
	  $$sudo apt-get update -qq && $$sudo $(APT_ENV) apt-get install -y -qq --no-install-recommends valgrind; }
	$(MAKE) --no-print-directory SANITIZE= CLONES= build/qtrain
	QTRAIN=./build/qtrain sh scripts/memcheck.sh

# ---- fuzzing (fuzz/README.md) ---------------------------------------------------
# The library and the harness compiled again by clang with libFuzzer's
# coverage, ASan and UBSan into build/fuzz/; each target then runs for
# FUZZ_SECONDS on its committed corpus fuzz/corpus/<target>/ (new inputs go
# to build/fuzz/corpus/<target>/, crashes to build/fuzz/artifacts/<target>/).
FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang
FUZZ_BUILD   := build/fuzz
FUZZ_TARGETS := config idx npy safetensors h5data checkpoint
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_CFLAGS  := -O1 -g -std=gnu11 -Wall -Wextra -I. -MMD -MP $(FUZZ_SAN)
FUZZ_HARNESS := tests/fuzz_harness.c tests/fuzz_h5edit.c tests/fuzz_h5edit_storage.c $(wildcard tests/fuzz_entry_*.c)
FUZZ_OBJS    := $(LIB_SRCS:%.c=$(FUZZ_BUILD)/%.o) $(FUZZ_HARNESS:%.c=$(FUZZ_BUILD)/%.o)
FUZZ_BINS    := $(FUZZ_TARGETS:%=$(FUZZ_BUILD)/fuzz_%)

$(FUZZ_BUILD)/%.o: %.c | pkgcheck
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link $(PKG_CFLAGS) -c $< -o $@

# nn/'s kernels (the forward pass run on a loaded model) keep the sanitizers
# but not libFuzzer's coverage: tracing their inner loops made the checkpoint
# target several times slower and guides nothing in the loaders.
$(FUZZ_BUILD)/nn/%.o: nn/%.c | pkgcheck
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(PKG_CFLAGS) -c $< -o $@

$(FUZZ_BUILD)/fuzz_%: $(FUZZ_BUILD)/fuzz/fuzz_%.o $(FUZZ_OBJS)
	$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer $^ -o $@ $(PKG_LIBS) $(LDLIBS)

# Kept after linking, so a second build compiles only what changed.
.SECONDARY: $(FUZZ_OBJS) $(FUZZ_TARGETS:%=$(FUZZ_BUILD)/fuzz/fuzz_%.o)

.PHONY: fuzz fuzz-build
fuzz-build: $(FUZZ_BINS)

fuzz: deps
	@command -v $(FUZZ_CC) >/dev/null 2>&1 || { echo "fuzz: $(FUZZ_CC) not found; install Debian's clang and" \
	  "libclang-rt-dev (or set FUZZ_CC)" >&2; exit 1; }
	$(MAKE) --no-print-directory fuzz-build
	OPENBLAS_NUM_THREADS=1 sh fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

clean:
	rm -rf build

-include $(shell find build -name '*.d' 2>/dev/null)
