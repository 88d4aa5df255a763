#pragma once
// What differs between the PyTorch versions ddpx builds against: 2.11 (the
// lent GPU machine's image) to 2.15 (our pin). Both ends are built and
// tested (README, "Supported PyTorch versions"); the versions between take
// whichever branch compiles against both ends where one exists (the older
// coalesced names are still aliases in 2.15).
//   - reconfigure (ReconfigureOptions, supportsReconfigure): torch's own
//     C10D_BACKEND_HAS_RECONFIGURE says whether Backend.hpp has it;
//   - Work::getTimeout and the *_single_coalesced names with their OpTypes:
//     2.15 (DDPX_TORCH_AT_LEAST(2, 15));
//   - autograd::impl::grad_accumulator: std::shared_ptr<Node> in 2.11,
//     c10::intrusive_ptr<Node> in 2.15 (GradAccumulatorPtr takes its type).
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <utility>

#define DDPX_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if DDPX_TORCH_AT_LEAST(2, 15)
#define DDPX_ALL_GATHER_SINGLE_COALESCED all_gather_single_coalesced
#define DDPX_REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_single_coalesced
#define DDPX_OPTYPE_ALL_GATHER_SINGLE_COALESCED c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED
#define DDPX_OPTYPE_REDUCE_SCATTER_SINGLE_COALESCED c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED
#else
#define DDPX_ALL_GATHER_SINGLE_COALESCED allgather_into_tensor_coalesced
#define DDPX_REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_tensor_coalesced
#define DDPX_OPTYPE_ALL_GATHER_SINGLE_COALESCED c10d::OpType::COALESCED
#define DDPX_OPTYPE_REDUCE_SCATTER_SINGLE_COALESCED c10d::OpType::COALESCED
#endif

namespace ddpx {

using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace ddpx
