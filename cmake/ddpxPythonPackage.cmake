# The pip build (pyproject.toml, scikit-build-core; SKBUILD is set): the
# library goes into the `ddpx` Python package and must be compiled against
# the torch it will load into -- the torch of the environment pip installs
# into, not one of an isolated build environment.
#
# pip's build isolation hides that environment's site-packages from the build
# backend's Python (a sitecustomize on PYTHONPATH drops them), yet sys.prefix
# still is the environment's; so torch is asked for first as is (no isolation,
# or a torch on PYTHONPATH) and then with the isolation's variables unset.
set(DDPX_TORCH_MIN 2.11)
set(DDPX_TORCH_MAX 2.15)

function(ddpx_torch_of_python python)
  set(probe "import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path)")
  foreach(attempt IN ITEMS as_is unisolated)
    set(cmd ${python})
    if(attempt STREQUAL "unisolated")
      set(cmd ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE ${python})
    endif()
    execute_process(COMMAND ${cmd} -c "${probe}" OUTPUT_VARIABLE out RESULT_VARIABLE rc
                    ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      break()
    endif()
  endforeach()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "ddpx: the Python that installs it (${python}) has no torch; install a "
                        "supported PyTorch (${DDPX_TORCH_MIN} to ${DDPX_TORCH_MAX}) first, then "
                        "pip install ddpx.\n${err}")
  endif()
  string(REPLACE "\n" ";" out "${out}")
  list(GET out 0 version)
  list(GET out 1 prefix)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" minor "${version}")
  if(minor VERSION_LESS DDPX_TORCH_MIN OR minor VERSION_GREATER DDPX_TORCH_MAX)
    message(FATAL_ERROR "ddpx supports PyTorch ${DDPX_TORCH_MIN} to ${DDPX_TORCH_MAX}, but "
                        "${python} has torch ${version}; install a supported torch first")
  endif()
  set(DDPX_PY_TORCH_VERSION "${version}" PARENT_SCOPE)
  set(DDPX_PY_TORCH_PREFIX "${prefix}" PARENT_SCOPE)
endfunction()

if(DEFINED SKBUILD)
  set(DDPX_PYTHON_PACKAGE ON)
  # scikit-build-core names the interpreter it runs under.
  if(DEFINED Python3_EXECUTABLE)
    set(_ddpx_python "${Python3_EXECUTABLE}")
  else()
    set(_ddpx_python "${Python_EXECUTABLE}")
  endif()
  ddpx_torch_of_python("${_ddpx_python}")
  # The objects scripts/setup.sh's build compiled are reused where they match
  # (the same launcher: ccache, keyed relative to the checkout).
  find_program(DDPX_CCACHE ccache)
  if(DDPX_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
    set(_launcher ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        ${DDPX_CCACHE})
    set(CMAKE_CXX_COMPILER_LAUNCHER ${_launcher})
    set(CMAKE_CUDA_COMPILER_LAUNCHER ${_launcher})
  endif()
  list(PREPEND CMAKE_PREFIX_PATH "${DDPX_PY_TORCH_PREFIX}")
  message(STATUS "ddpx: Python package build against torch ${DDPX_PY_TORCH_VERSION} "
                 "(${DDPX_PY_TORCH_PREFIX})")
endif()

# After the targets exist: where the package's libraries find each other and
# torch's (site-packages/ddpx/lib -> site-packages/torch/lib, as torchvision's
# extension finds it), and what `import ddpx` reads about the build.
function(ddpx_python_package_install)
  if(NOT DDPX_PYTHON_PACKAGE)
    return()
  endif()
  foreach(t ddpx ddpx_python ddpx_cuda)
    if(TARGET ${t})
      set_target_properties(${t} PROPERTIES INSTALL_RPATH "$ORIGIN;$ORIGIN/../../torch/lib")
    endif()
  endforeach()
  set(DDPX_BUILD_INFO_VERSION "${PROJECT_VERSION}")
  set(DDPX_BUILD_INFO_TORCH "${DDPX_PY_TORCH_VERSION}")
  configure_file(${PROJECT_SOURCE_DIR}/cmake/_build_info.py.in
                 ${PROJECT_BINARY_DIR}/_build_info.py @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/_build_info.py DESTINATION .)
endfunction()
