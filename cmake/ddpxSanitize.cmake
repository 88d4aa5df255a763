# Instrumented builds (scripts/sanitize.sh, scripts/fuzz.sh). Applied to every
# target of the tree -- the library, the trainer, the tests -- before any is
# made; LibTorch, Open MPI and Gloo stay as shipped (uninstrumented), which is
# why the run-time options and suppressions live in tests/sanitize/.
#
#   DDPX_SANITIZE=address  AddressSanitizer + UndefinedBehaviorSanitizer
#   DDPX_SANITIZE=thread   ThreadSanitizer
#   DDPX_BUILD_FUZZ=ON     the libFuzzer targets (tests/fuzz); clang only, and
#                          with DDPX_SANITIZE=address: the library is also
#                          compiled with libFuzzer's coverage hooks
set(DDPX_SANITIZE "" CACHE STRING "Instrument everything: address (ASan+UBSan) or thread (TSan)")
set_property(CACHE DDPX_SANITIZE PROPERTY STRINGS "" address thread)
option(DDPX_BUILD_FUZZ "Build the libFuzzer targets (tests/fuzz; needs clang and DDPX_SANITIZE=address)" OFF)

if(DDPX_SANITIZE STREQUAL "address")
  # UBSan's checks abort with a stack (halt_on_error in the run-time
  # options); vptr is on: LibTorch ships its RTTI.
  set(_ddpx_san -fsanitize=address,undefined -fno-omit-frame-pointer)
elseif(DDPX_SANITIZE STREQUAL "thread")
  set(_ddpx_san -fsanitize=thread -fno-omit-frame-pointer)
elseif(NOT DDPX_SANITIZE STREQUAL "")
  message(FATAL_ERROR "DDPX_SANITIZE must be address, thread or empty; got '${DDPX_SANITIZE}'")
endif()
if(_ddpx_san)
  add_compile_options(${_ddpx_san} -g)
  add_link_options(${_ddpx_san})
endif()

if(DDPX_BUILD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang" OR NOT DDPX_SANITIZE STREQUAL "address")
    message(FATAL_ERROR "DDPX_BUILD_FUZZ needs clang and DDPX_SANITIZE=address (scripts/fuzz.sh sets both)")
  endif()
  # Coverage hooks everywhere (the parsers live in the library and the
  # trainer); only the fuzz targets link libFuzzer's main (-fsanitize=fuzzer).
  # The ASan run-time gives the hooks their defaults in everything else.
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

# Run-time options of every test in an instrumented tree (ctest ENVIRONMENT;
# mpirun passes them on to its ranks). Suppressions: tests/sanitize/*.supp,
# each entry with the reason it is not ours to fix.
set(DDPX_SANITIZER_ENV "")
set(DDPX_SANITIZER_MPI_ENV "")  # overrides for tests under mpirun
set(DDPX_PYTHON_LAUNCH "")  # prefix of the Python fixtures' command line
set(_supp ${CMAKE_CURRENT_SOURCE_DIR}/tests/sanitize)
if(DDPX_SANITIZE STREQUAL "address")
  set(DDPX_SANITIZER_ENV
      "ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:check_initialization_order=1"
      "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:suppressions=${_supp}/ubsan.supp"
      "LSAN_OPTIONS=suppressions=${_supp}/lsan.supp:print_suppressions=0"
      # Open MPI keeps its components loaded at finalize, so the leak report
      # can name them (tests/sanitize/lsan.supp) instead of <unknown module>.
      "OMPI_MCA_mca_base_component_disable_dlclose=1")
  # Multi-rank tests (under mpirun): no leak check. Open MPI leaves hundreds
  # of allocations at finalize inside components it has already unloaded, so
  # no suppression can name them (tests/sanitize/lsan.supp); memory errors
  # and UB are still checked there, and leaks by the unit tests, the fuzz
  # targets and the GradSync churn of scripts/bench/soak.
  set(DDPX_SANITIZER_MPI_ENV
      "ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:check_initialization_order=1")
  set(_rt libclang_rt.asan-x86_64.so)
elseif(DDPX_SANITIZE STREQUAL "thread")
  # OMP_NUM_THREADS=1: TSan cannot see the barriers of an uninstrumented
  # OpenMP run time, so every parallel region would report; ATen's and our
  # parallel_for loops run on one thread here (their partitions are checked
  # by the reference comparisons of the normal tests).
  set(DDPX_SANITIZER_ENV
      "TSAN_OPTIONS=halt_on_error=0:second_deadlock_stack=1:suppressions=${_supp}/tsan.supp"
      "OMP_NUM_THREADS=1")
  set(_rt libclang_rt.tsan-x86_64.so)
endif()
if(_rt)
  # A Python that scripts a test's model loads the instrumented libddpx.so:
  # the sanitizer's run time must be in the process first (LD_PRELOAD). Only
  # those helper processes; Python itself and torch are not under test.
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=${_rt}
                  OUTPUT_VARIABLE _rt_path OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(DDPX_PYTHON_LAUNCH ${CMAKE_COMMAND} -E env LD_PRELOAD=${_rt_path}
      ASAN_OPTIONS=detect_leaks=0 TSAN_OPTIONS=report_bugs=0)
endif()
if(DDPX_SANITIZER_ENV)
  # The same options for scripts that run the tree's programs outside ctest
  # (scripts/fuzz.sh): source build-*/sanitizer_env.sh.
  list(TRANSFORM DDPX_SANITIZER_ENV PREPEND "export " OUTPUT_VARIABLE _exports)
  list(JOIN _exports "\n" _exports)
  file(WRITE ${CMAKE_BINARY_DIR}/sanitizer_env.sh "# written by cmake/ddpxSanitize.cmake\n${_exports}\n")
endif()
