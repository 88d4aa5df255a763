// The persistent GRU recurrence on CUDA: one cooperative launch per layer and
// direction, forward and backward (the plan, the phases and why in
// kernels/common/gru_persistent.h; tests/cpp/test_gru_persistent.cpp emulates
// these two kernels' loops block by block on the CPU).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/gru_persistent_launch.h"

namespace ddpx::detail {
namespace {

namespace cg = cooperative_groups;
using persist::kThreads;

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads)
    gru_forward_persistent_kernel(persist::SeqForward<T> p, persist::Plan plan) {
  extern __shared__ __align__(16) unsigned char smem[];
  const auto [red, w, x] = persist::carve<T, Acc>(
      smem, persist::layout(plan, /*backward=*/false, sizeof(T), sizeof(Acc)));
  const int block = blockIdx.x, th = threadIdx.x;
  const int uj = persist::units_of(plan, p.hidden, block);
  persist::load_forward_weights(p, plan, block, w, th);
  cg::grid_group grid = cg::this_grid();
  for (int64_t step = 0; step < p.steps; ++step) {
    for (int64_t b0 = 0; b0 < p.batch; b0 += plan.chunk) {
      const int bc = persist::chunk_rows(plan, p.batch, b0);
      const persist::DotSplit s = persist::dot_split(3 * uj, bc, plan.lanes);
      __syncthreads();  // the weights loaded; the last chunk's x and red read
      persist::stage_forward_chunk(p, plan, step, b0, bc, x, th);
      __syncthreads();
      persist::dot_phase<T, Acc>(s, 3 * uj, bc, p.hidden, plan.ld, w, x, red, th);
      __syncthreads();
      if (persist::folds(s)) {  // (the plan's lanes: the same in every block)
        persist::fold_phase(s, red, th);
        __syncthreads();
      }
      persist::forward_gates_phase<T, Acc>(p, plan, block, step, b0, bc, x, red, th);
    }
    grid.sync();  // every block's h_t written and visible
  }
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads)
    gru_backward_persistent_kernel(persist::SeqBackward<T> p, persist::Plan plan) {
  extern __shared__ __align__(16) unsigned char smem[];
  const auto [red, w, x] = persist::carve<T, Acc>(
      smem, persist::layout(plan, /*backward=*/true, sizeof(T), sizeof(Acc)));
  const int block = blockIdx.x, th = threadIdx.x;
  const int uj = persist::units_of(plan, p.hidden, block);
  const int64_t k = 3 * p.hidden;
  persist::load_backward_weights(p, plan, block, w, th);
  cg::grid_group grid = cg::this_grid();
  // step -1: dL/dh0 from the carry and dh_proj of step 0.
  for (int64_t step = p.steps - 1; step >= -1; --step) {
    const bool dots = step < p.steps - 1;
    for (int64_t b0 = 0; b0 < p.batch; b0 += plan.chunk) {
      const int bc = persist::chunk_rows(plan, p.batch, b0);
      const persist::DotSplit s = persist::dot_split(uj, bc, plan.lanes);
      __syncthreads();  // the weights loaded; the last chunk's x and red read
      if (dots) {
        persist::stage_backward_chunk(p, plan, step, b0, bc, x, th);
        __syncthreads();
        persist::dot_phase<T, Acc>(s, uj, bc, k, plan.ld, w, x, red, th);
        __syncthreads();
        if (persist::folds(s)) {
          persist::fold_phase(s, red, th);
          __syncthreads();
        }
      }
      persist::backward_gates_phase<T, Acc>(p, plan, block, step, b0, bc, dots, red, th);
    }
    if (step >= 0) grid.sync();  // every block's dh_proj[t] written and visible
  }
}

template <typename T>
persist::SeqForward<T> typed(const persist::SeqForward<void>& p) {
  persist::SeqForward<T> q;
  q.steps = p.steps, q.batch = p.batch, q.hidden = p.hidden, q.reverse = p.reverse;
  q.x_proj = static_cast<const T*>(p.x_proj), q.w_hh = static_cast<const T*>(p.w_hh);
  q.b_ih = static_cast<const T*>(p.b_ih), q.b_hh = static_cast<const T*>(p.b_hh);
  q.h0 = static_cast<const T*>(p.h0), q.out = static_cast<T*>(p.out);
  q.out_row = p.out_row, q.out_step = p.out_step, q.gates = static_cast<T*>(p.gates);
  return q;
}

template <typename T>
persist::SeqBackward<T> typed(const persist::SeqBackward<void>& p) {
  persist::SeqBackward<T> q;
  q.steps = p.steps, q.batch = p.batch, q.hidden = p.hidden, q.reverse = p.reverse;
  q.w_hh = static_cast<const T*>(p.w_hh), q.grad_out = static_cast<const T*>(p.grad_out);
  q.grad_out_row = p.grad_out_row, q.grad_out_step = p.grad_out_step;
  q.gates = static_cast<const T*>(p.gates), q.h0 = static_cast<const T*>(p.h0);
  q.out = static_cast<const T*>(p.out), q.out_row = p.out_row, q.out_step = p.out_step;
  q.dx_proj = static_cast<T*>(p.dx_proj), q.dh_proj = static_cast<T*>(p.dh_proj);
  q.dh = static_cast<T*>(p.dh);
  return q;
}

// The plan of one kernel for one problem on one device: one block per SM at
// most, the shared memory the device lets a block opt in to, and the kernel's
// own occupancy (registers) confirming that every block is co-resident, as a
// cooperative launch requires. Cached: a lookup per launch.
persist::Plan plan_for(const void* kernel, int device, int64_t hidden, int64_t batch, int elem,
                       int acc, bool backward) {
  using Key = std::tuple<const void*, int, int64_t, int64_t>;
  static std::mutex mutex;
  static std::map<Key, persist::Plan> plans;
  const Key key{kernel, device, hidden, batch};
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  persist::Plan plan;
  if (props->cooperativeLaunch) {
    plan = persist::make_plan(hidden, batch, elem, acc, props->multiProcessorCount,
                              static_cast<int64_t>(props->sharedMemPerBlockOptin), backward);
  }
  if (plan.blocks > 0) {
    // (The attribute and the occupancy are the current device's: `device`'s,
    // which the plan is cached under, whichever device the caller was on.)
    const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device));
    // The same value for every plan of this kernel: a launch of another
    // problem on another thread never sees a smaller one.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(props->sharedMemPerBlockOptin)));
    int per_sm = 0;
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, plan.smem_bytes));
    if (int64_t{per_sm} * props->multiProcessorCount < plan.blocks) plan = persist::Plan{};
  }
  plans.emplace(key, plan);
  return plan;
}

// The kernel of one pass for storage type T, as the runtime API takes it.
template <typename T>
const void* kernel_of(bool backward) {
  using Acc = at::opmath_type<T>;
  return backward ? reinterpret_cast<const void*>(&gru_backward_persistent_kernel<T, Acc>)
                  : reinterpret_cast<const void*>(&gru_forward_persistent_kernel<T, Acc>);
}

template <typename T>
persist::Plan plan_of(bool backward, int device, int64_t hidden, int64_t batch) {
  return plan_for(kernel_of<T>(backward), device, hidden, batch, sizeof(T),
                  sizeof(at::opmath_type<T>), backward);
}

// One pass's cooperative launch on the current stream; false (nothing
// launched) where the persistent kernels do not serve the problem.
template <typename Seq>
bool launch_pass(c10::ScalarType dtype, const Seq& p, bool backward) {
  if (p.steps <= 0 || p.batch <= 0) return false;
  const int device = c10::cuda::current_device();
  if (!gru_persistent_serves(device, p.hidden, p.batch, dtype)) return false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "gru_persistent", [&] {
    auto args = typed<scalar_t>(p);
    persist::Plan plan = plan_of<scalar_t>(backward, device, p.hidden, p.batch);
    void* params[] = {&args, &plan};
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel(
        kernel_of<scalar_t>(backward), dim3(plan.blocks), dim3(kThreads), params,
        static_cast<size_t>(plan.smem_bytes), at::cuda::getCurrentCUDAStream()));
  });
  return true;
}

}  // namespace

bool gru_persistent_serves(int device, int64_t hidden, int64_t batch, c10::ScalarType dtype) {
  bool serves = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "gru_persistent_serves", [&] {
    serves = plan_of<scalar_t>(false, device, hidden, batch).blocks > 0 &&
             plan_of<scalar_t>(true, device, hidden, batch).blocks > 0;
  });
  return serves;
}

bool gru_persistent_forward(c10::ScalarType dtype, const persist::SeqForward<void>& p) {
  return launch_pass(dtype, p, /*backward=*/false);
}

bool gru_persistent_backward(c10::ScalarType dtype, const persist::SeqBackward<void>& p) {
  return launch_pass(dtype, p, /*backward=*/true);
}

}  // namespace ddpx::detail
