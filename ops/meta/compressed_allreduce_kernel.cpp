// Meta kernels of ddpx::compressed_allreduce(_packed): the mean has the input's shape
// and dtype. The door checks run here too, so tracing rejects what eager would.
#include <ATen/ATen.h>
#include <ddpx/codec.h>
#include <torch/library.h>

#include "plugin/comm/codec_util.h"

namespace ddpx {
namespace {

at::Tensor compressed_allreduce_meta(const at::Tensor& input, c10::string_view codec,
                                     c10::string_view key, c10::string_view group) {
  auto c = comm::make_codec(std::string(codec));
  comm::detail::check_input(input, c->spec());
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

at::Tensor compressed_allreduce_packed_meta(const at::Tensor& flat, c10::IntArrayRef part_sizes,
                                            c10::IntArrayRef part_dims,
                                            const std::vector<std::string>& part_keys,
                                            c10::string_view codec, c10::string_view key,
                                            c10::string_view group) {
  auto c = comm::make_codec(std::string(codec));
  TORCH_CHECK(flat.dim() == 1, "ddpx::compressed_allreduce_packed: flat must be 1-D, got ",
              flat.sizes());
  return at::empty_like(flat, at::MemoryFormat::Contiguous);
}

TORCH_LIBRARY_IMPL(ddpx, Meta, m) {
  m.impl("compressed_allreduce", &compressed_allreduce_meta);
  m.impl("compressed_allreduce_packed", &compressed_allreduce_packed_meta);
}

}  // namespace
}  // namespace ddpx
