// ddpx::compressed_allreduce(Tensor input, str codec="none", str key="",
//                            str group="") -> Tensor
//   The mean of `input` over the ranks of `group`, sent through `codec` (the
//   grammar is in ddpx/codec.h). Every rank calls it with the same shape,
//   dtype, codec and key, in the same order; input is not modified; the result
//   has input's shape, dtype and device. `key` names the codec's persistent
//   state (error-feedback residual, PowerSGD Q); "" is stateless. `group` ""
//   is the world group (ddpx_mpi under mpirun, else torch.distributed's
//   default), otherwise a registered group name.
// ddpx::compressed_allreduce_packed(Tensor flat, int[] part_sizes,
//     int[] part_dims, str[] part_keys, str codec="none", str key="",
//     str group="") -> Tensor
//   The same for several tensors packed end to end in the 1-D `flat` (a DDP
//   bucket): part i has the shape part_sizes[sum(part_dims[:i]) :][:part_dims[i]]
//   and is compressed on its own (int8's chunks, top-k's budget, PowerSGD's
//   matrix), as GradSync's buckets are. part_keys (empty, or one per part)
//   keep per-part state that outlives a re-bucketing (PowerSGD's warm start);
//   `key` holds the bucket's residual.
// ddpx::codec_stats(str codec="none", str group="") -> int[]
//   [calls, bytes_sent, bytes_raw] of the (codec, group) pair so far.
// ddpx::codec_reset(str codec="none", str key="", str group="") -> ()
//   Drops one key's state ("" = all keys) of the (codec, group) pair.
//
// One codec object per (canonical codec spec, group name), kept for the life
// of the process so that a key's state persists across calls. CPU and CUDA
// kernels are the same code: the codec runs over the group's backend for the
// tensor's device (NCCL for CUDA through torch's own process group).
#include <ddpx/codec.h>
#include <ddpx/ops.h>
#include <torch/library.h>

#include <map>
#include <mutex>

#include "plugin/comm/codec_util.h"

namespace ddpx {
namespace {

using CodecPtr = std::shared_ptr<comm::Codec>;

std::mutex& cache_mu() {
  static std::mutex m;
  return m;
}
// Leaked on purpose: codecs hold device tensors that must not be freed after
// the CUDA runtime has shut down at exit.
std::map<std::pair<std::string, std::string>, CodecPtr>& cache() {
  static auto* c = new std::map<std::pair<std::string, std::string>, CodecPtr>();
  return *c;
}

// create=false: nullptr when the pair was never used (the spec is still checked).
CodecPtr codec_for(const std::string& spec, const std::string& group, bool create) {
  auto fresh = comm::make_codec(spec);
  std::lock_guard<std::mutex> lock(cache_mu());
  auto& slot = cache()[{fresh->spec(), group}];
  if (!slot && create) slot = std::move(fresh);
  return slot;
}

at::Tensor compressed_allreduce_kernel(const at::Tensor& input, c10::string_view codec,
                                       c10::string_view key, c10::string_view group) {
  const std::string g(group);
  CodecPtr c = codec_for(std::string(codec), g, /*create=*/true);
  comm::detail::check_input(input, c->spec());
  auto pg = comm::resolve_group(g);
  return c->allreduce_mean(input, std::string(key), *pg);
}

// The parts' shapes from the flattened sizes and each part's dimension count.
std::vector<std::vector<int64_t>> part_shapes(c10::IntArrayRef sizes, c10::IntArrayRef dims) {
  std::vector<std::vector<int64_t>> shapes;
  size_t at = 0;
  for (int64_t d : dims) {
    TORCH_CHECK(d >= 0 && at + d <= sizes.size(), "ddpx::compressed_allreduce_packed: part_dims ",
                dims, " does not fit part_sizes ", sizes);
    shapes.emplace_back(sizes.begin() + at, sizes.begin() + at + d);
    at += d;
  }
  TORCH_CHECK(at == sizes.size(), "ddpx::compressed_allreduce_packed: part_sizes ", sizes, " has ",
              sizes.size() - at, " entries beyond the part_dims ", dims);
  return shapes;
}

at::Tensor compressed_allreduce_packed_kernel(const at::Tensor& flat, c10::IntArrayRef part_sizes,
                                              c10::IntArrayRef part_dims,
                                              const std::vector<std::string>& part_keys,
                                              c10::string_view codec, c10::string_view key,
                                              c10::string_view group) {
  const std::string g(group);
  CodecPtr c = codec_for(std::string(codec), g, /*create=*/true);
  const auto shapes = part_shapes(part_sizes, part_dims);
  comm::detail::check_packed(flat, shapes, c->spec());
  auto pg = comm::resolve_group(g);
  return c->allreduce_mean_packed(flat, shapes, std::string(key), *pg, part_keys);
}

std::vector<int64_t> codec_stats(c10::string_view codec, c10::string_view group) {
  CodecPtr c = codec_for(std::string(codec), std::string(group), /*create=*/false);
  if (!c) return {0, 0, 0};
  const auto s = c->stats();
  return {s.calls, s.bytes_sent, s.bytes_raw};
}

void codec_reset(c10::string_view codec, c10::string_view key, c10::string_view group) {
  CodecPtr c = codec_for(std::string(codec), std::string(group), /*create=*/false);
  if (c) c->reset_state(std::string(key));
}

}  // namespace

at::Tensor compressed_allreduce(const at::Tensor& input, const std::string& codec,
                                const std::string& key, const std::string& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::compressed_allreduce", "")
                       .typed<at::Tensor(const at::Tensor&, c10::string_view, c10::string_view,
                                         c10::string_view)>();
  return op.call(input, codec, key, group);
}

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def(
      "compressed_allreduce(Tensor input, str codec=\"none\", str key=\"\", str group=\"\") -> "
      "Tensor");
  m.def(
      "compressed_allreduce_packed(Tensor flat, int[] part_sizes, int[] part_dims, "
      "str[] part_keys, str codec=\"none\", str key=\"\", str group=\"\") -> Tensor");
  m.def("codec_stats(str codec=\"none\", str group=\"\") -> int[]", &codec_stats);
  m.def("codec_reset(str codec=\"none\", str key=\"\", str group=\"\") -> ()", &codec_reset);
}

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("compressed_allreduce", &compressed_allreduce_kernel);
  m.impl("compressed_allreduce_packed", &compressed_allreduce_packed_kernel);
}
TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("compressed_allreduce", &compressed_allreduce_kernel);
  m.impl("compressed_allreduce_packed", &compressed_allreduce_packed_kernel);
}

}  // namespace ddpx
