# Executables linked against torch's CUDA wheel: libtorch_cuda.so needs the
# wheel's own NCCL/cuDNN/... (site-packages/nvidia/*/lib), but ld would find an
# older copy in the CUDA toolkit first and fail (e.g. missing ncclCommResume).
# Put the wheel's directories first on -rpath-link. Used by our build and by
# ddpxConfig.cmake, so a consumer's executables link the same way.
function(ddpx_wheel_link_options out_var torch_prefix)
  file(GLOB _dirs LIST_DIRECTORIES true "${torch_prefix}/../nvidia/*/lib")
  set(_opts "")
  foreach(_d ${_dirs})
    get_filename_component(_d "${_d}" REALPATH)
    list(APPEND _opts "LINKER:-rpath-link,${_d}")
  endforeach()
  set(${out_var} "${_opts}" PARENT_SCOPE)
endfunction()
