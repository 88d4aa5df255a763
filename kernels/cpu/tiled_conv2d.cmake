# The direct-path inner loops of tiled_conv2d (tiled_conv2d_vec.cpp) built once
# per CPU capability, each with its own -m flags and at::vec namespace (as
# ATen builds its kernels/ files); the library picks one at run time, so the
# plugin still loads on a CPU without AVX2.
set(_ddpx_conv_flags_DEFAULT "")
set(_ddpx_conv_flags_AVX2 -mavx2 -mfma -mf16c)
set(_ddpx_conv_flags_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c)
foreach(_cap DEFAULT AVX2 AVX512)
  set(_obj ddpx_tiled_conv2d_vec_${_cap})
  add_library(${_obj} OBJECT ${CMAKE_CURRENT_LIST_DIR}/tiled_conv2d_vec.cpp)
  target_include_directories(${_obj} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${_obj} PRIVATE ${TORCH_LIBRARIES})
  target_compile_definitions(${_obj} PRIVATE CPU_CAPABILITY=${_cap} CPU_CAPABILITY_${_cap})
  target_compile_options(${_obj} PRIVATE -O3 ${_ddpx_conv_flags_${_cap}})
  target_sources(ddpx PRIVATE $<TARGET_OBJECTS:${_obj}>)
endforeach()
