# Precompiled LibTorch headers (DDPX_PCH) and unity batches (DDPX_UNITY).
#
# Why, measured on our 2-core machine (g++ 12, -O3): LibTorch's headers that
# our sources use (ATen, torch/script.h, the optimizers, c10d) take 26 s to
# parse in each translation unit that includes them; loaded from a PCH they
# take 7 s (a 614 MB .gch: loading is not free, so a file that needs only
# ATen/core/Tensor.h is faster without it, 1.6 s against 8.7). hooks/
# grad_sync.cpp: 24 s alone, 12 s with the PCH. Unity batches of 8 sources
# pay the PCH load once per batch: the library's sources build in 11
# batches of 15-31 s each.
#
# The library's sources are position-independent (-fPIC) and the
# executables' are not (-fPIE); GCC refuses a PCH built with the other
# setting, so the executables reuse the PCH of `ddpx_exe_pch`, an executable
# that exists only to own it (REUSE_FROM needs matching flags).
option(DDPX_PCH "Precompile the LibTorch headers (faster builds)" ON)
set(DDPX_UNITY 8 CACHE STRING "Unity build: library sources per translation unit (0: off)")

set(DDPX_PCH_LIBRARY_HEADERS
  <algorithm> <atomic> <chrono> <functional> <map> <memory> <mutex> <optional>
  <string> <unordered_map> <vector>
  <ATen/ATen.h>
  <ATen/Parallel.h>
  <torch/library.h>
  <torch/optim/optimizer.h>
  <torch/script.h>
  <torch/csrc/autograd/engine.h>
  <torch/csrc/autograd/variable.h>
  <torch/csrc/distributed/c10d/Backend.hpp>
  <torch/csrc/distributed/c10d/ProcessGroup.hpp>
  <torch/csrc/distributed/c10d/Store.hpp>)
set(DDPX_PCH_EXE_HEADERS ${DDPX_PCH_LIBRARY_HEADERS} <torch/torch.h>)

# The library's own PCH, and its sources in unity batches. Sources whose
# macros change what LibTorch's headers mean (CPU_CAPABILITY, USE_C10D_*)
# opt out of both with ddpx_no_pch().
function(ddpx_library_pch target)
  if(DDPX_PCH)
    target_precompile_headers(${target} PRIVATE ${DDPX_PCH_LIBRARY_HEADERS})
    _ddpx_pch_for_ccache(${target})
  endif()
  if(DDPX_UNITY)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${DDPX_UNITY})
  endif()
endfunction()

function(ddpx_no_pch)
  set_source_files_properties(${ARGN} TARGET_DIRECTORY ddpx PROPERTIES
                              SKIP_PRECOMPILE_HEADERS ON SKIP_UNITY_BUILD_INCLUSION ON)
endfunction()

# ccache caches a Clang PCH (and what uses it) only without the timestamp
# Clang writes into it by default.
function(_ddpx_pch_for_ccache target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    target_compile_options(${target} PRIVATE "SHELL:-Xclang -fno-pch-timestamp")
  endif()
endfunction()

# ddpx_exe_pch(TARGET): an executable linking ddpx reuses the shared PCH.
function(ddpx_exe_pch target)
  if(NOT DDPX_PCH)
    return()
  endif()
  if(NOT TARGET ddpx_exe_pch)
    set(_src ${CMAKE_BINARY_DIR}/ddpx_exe_pch.cpp)
    file(GENERATE OUTPUT ${_src} CONTENT "int main() { return 0; }\n")
    add_executable(ddpx_exe_pch EXCLUDE_FROM_ALL ${_src})
    target_link_libraries(ddpx_exe_pch PRIVATE ${TORCH_LIBRARIES})
    target_link_options(ddpx_exe_pch PRIVATE ${DDPX_WHEEL_LINK_OPTIONS})
    # What the test programs define (MPI's C API only); ddpx_exe_pch()
    # gives every user of the PCH the same.
    target_compile_definitions(ddpx_exe_pch PRIVATE OMPI_SKIP_MPICXX=1)
    target_precompile_headers(ddpx_exe_pch PRIVATE ${DDPX_PCH_EXE_HEADERS})
    _ddpx_pch_for_ccache(ddpx_exe_pch)
  endif()
  target_precompile_headers(${target} REUSE_FROM ddpx_exe_pch)
  # GCC uses a PCH only where every macro defined when it was made is
  # defined alike.
  target_compile_definitions(${target} PRIVATE OMPI_SKIP_MPICXX=1)
endfunction()
