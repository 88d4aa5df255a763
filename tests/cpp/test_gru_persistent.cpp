// The persistent CUDA GRU recurrence (kernels/common/gru_persistent.h, launched
// by kernels/cuda/gru_persistent_kernel.cu) run on the CPU: every block and
// every thread of a launch emulated with the same phase functions, in the
// kernels' order (a barrier between phases, a grid-wide sync between time
// steps; the blocks of a step in a shuffled order, since the GPU runs them in
// any), against the GRU recurrence written in ATen, and its backward against
// autograd through that, in double. Plans with ragged blocks, ragged batch
// chunks, more tiles than threads and a direction's column slot in a
// bidirectional output. Plus the plans chosen for the H200's limits.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/common/gru_persistent.h"

namespace ddpx::detail::persist {
namespace {

// The H200's limits (cudaDeviceProp): 132 SMs, 227 KiB of shared memory a
// block may opt in to.
constexpr int kH200Sms = 132;
constexpr int64_t kH200Smem = 232448;

// One block's shared memory, filled with NaN bytes (a phase that reads what
// no phase wrote shows up in the result), cut as the kernels cut it.
template <typename T, typename Acc>
struct BlockMemory {
  std::vector<unsigned char> bytes;  // (moving the vector keeps its buffer)
  Carved<T, Acc> at;
  explicit BlockMemory(const Layout& l)
      : bytes(static_cast<size_t>(l.bytes), 0xff), at(carve<T, Acc>(bytes.data(), l)) {}
};

// A block's use of its shared memory fits what the plan reserved, and its
// threads cover its tiles' lanes.
void expect_fits(const Layout& l, const Plan& plan, const DotSplit& s, int rows, int bc, int64_t k,
                 int acc_size, int elem_size) {
  EXPECT_LE(int64_t{kRows} * kCols * s.tiles * s.lanes * acc_size, l.w - l.red);
  EXPECT_LE((int64_t{rows} - 1) * plan.ld + k, (l.x - l.w) / elem_size);
  EXPECT_LE((int64_t{bc} - 1) * plan.ld + k, (l.bytes - l.x) / elem_size);
  EXPECT_GE(plan.ld, k);
  EXPECT_TRUE(s.tiles * s.lanes <= kThreads || s.lanes == 1);
}

std::vector<int> shuffled_blocks(int blocks, std::mt19937& gen) {
  std::vector<int> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), gen);
  return order;
}

template <typename F>
void each_thread(F&& f) {
  for (int th = kThreads - 1; th >= 0; --th) f(th);  // any order: threads write disjoint outputs
}

// gru_forward_persistent_kernel, emulated.
template <typename T, typename Acc>
void emulate_forward(const SeqForward<T>& p, const Plan& plan, std::mt19937& gen) {
  const Layout l = layout(plan, false, sizeof(T), sizeof(Acc));
  std::vector<BlockMemory<T, Acc>> smem;
  for (int block = 0; block < plan.blocks; ++block) {
    T* w = smem.emplace_back(l).at.w;
    each_thread([&](int th) { load_forward_weights(p, plan, block, w, th); });
  }
  for (int64_t step = 0; step < p.steps; ++step) {
    for (const int block : shuffled_blocks(plan.blocks, gen)) {
      Acc* red = smem[block].at.red;
      T* w = smem[block].at.w;
      T* x = smem[block].at.x;
      const int uj = units_of(plan, p.hidden, block);
      for (int64_t b0 = 0; b0 < p.batch; b0 += plan.chunk) {
        const int bc = chunk_rows(plan, p.batch, b0);
        const DotSplit s = dot_split(3 * uj, bc, plan.lanes);
        expect_fits(l, plan, s, 3 * uj, bc, p.hidden, sizeof(Acc), sizeof(T));
        each_thread([&](int th) { stage_forward_chunk(p, plan, step, b0, bc, x, th); });
        each_thread(
            [&](int th) { dot_phase<T, Acc>(s, 3 * uj, bc, p.hidden, plan.ld, w, x, red, th); });
        if (folds(s)) each_thread([&](int th) { fold_phase(s, red, th); });
        each_thread(
            [&](int th) { forward_gates_phase<T, Acc>(p, plan, block, step, b0, bc, x, red, th); });
      }
    }
  }
}

// gru_backward_persistent_kernel, emulated.
template <typename T, typename Acc>
void emulate_backward(const SeqBackward<T>& p, const Plan& plan, std::mt19937& gen) {
  const Layout l = layout(plan, true, sizeof(T), sizeof(Acc));
  const int64_t k = 3 * p.hidden;
  std::vector<BlockMemory<T, Acc>> smem;
  for (int block = 0; block < plan.blocks; ++block) {
    T* w = smem.emplace_back(l).at.w;
    each_thread([&](int th) { load_backward_weights(p, plan, block, w, th); });
  }
  for (int64_t step = p.steps - 1; step >= -1; --step) {
    const bool dots = step < p.steps - 1;
    for (const int block : shuffled_blocks(plan.blocks, gen)) {
      Acc* red = smem[block].at.red;
      T* w = smem[block].at.w;
      T* x = smem[block].at.x;
      const int uj = units_of(plan, p.hidden, block);
      for (int64_t b0 = 0; b0 < p.batch; b0 += plan.chunk) {
        const int bc = chunk_rows(plan, p.batch, b0);
        const DotSplit s = dot_split(uj, bc, plan.lanes);
        expect_fits(l, plan, s, uj, bc, k, sizeof(Acc), sizeof(T));
        if (dots) {
          each_thread([&](int th) { stage_backward_chunk(p, plan, step, b0, bc, x, th); });
          each_thread([&](int th) { dot_phase<T, Acc>(s, uj, bc, k, plan.ld, w, x, red, th); });
          if (folds(s)) each_thread([&](int th) { fold_phase(s, red, th); });
        }
        each_thread([&](int th) {
          backward_gates_phase<T, Acc>(p, plan, block, step, b0, bc, dots, red, th);
        });
      }
    }
  }
}

// nn.GRU's recurrence over a precomputed input projection, in ATen.
at::Tensor reference_forward(const at::Tensor& x_proj, const at::Tensor& w_hh,
                             const at::Tensor& b_ih, const at::Tensor& b_hh, const at::Tensor& h0,
                             bool reverse) {
  const int64_t T = x_proj.size(0);
  std::vector<at::Tensor> outs(T);
  at::Tensor h = h0;
  for (int64_t step = 0; step < T; ++step) {
    const int64_t t = time_of(step, T, reverse);
    at::Tensor gi = x_proj[t], gh = h.mm(w_hh.t());
    if (b_ih.defined()) gi = gi + b_ih;
    if (b_hh.defined()) gh = gh + b_hh;
    const auto i = gi.chunk(3, 1), g = gh.chunk(3, 1);
    const at::Tensor r = at::sigmoid(i[0] + g[0]), z = at::sigmoid(i[1] + g[1]);
    const at::Tensor n = at::tanh(i[2] + r * g[2]);
    h = n + z * (h - n);
    outs[t] = h;
  }
  return at::stack(outs);
}

struct Case {
  int64_t steps, batch, hidden;
  bool reverse, biases;
  int max_blocks;
  int64_t max_smem;
  bool column_slot;  // h_t in columns [hidden, 2*hidden) of a [steps, batch, 2*hidden] output
};

class GruPersistent : public ::testing::TestWithParam<Case> {};

// Forward and backward of one direction, T = double, against ATen in double.
TEST_P(GruPersistent, EmulationMatchesAten) {
  const Case c = GetParam();
  const int64_t T = c.steps, B = c.batch, H = c.hidden, DH = c.column_slot ? 2 * H : H;
  const int64_t col = c.column_slot ? H : 0;
  const Plan fwd = make_plan(H, B, 8, 8, c.max_blocks, c.max_smem, false);
  const Plan bwd = make_plan(H, B, 8, 8, c.max_blocks, c.max_smem, true);
  ASSERT_GT(fwd.blocks, 0);
  ASSERT_GT(bwd.blocks, 0);
  torch::manual_seed(7);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x_proj = at::randn({T, B, 3 * H}, o), w_hh = at::randn({3 * H, H}, o) * 0.4;
  const at::Tensor b_ih = c.biases ? at::randn({3 * H}, o) : at::Tensor();
  const at::Tensor b_hh = c.biases ? at::randn({3 * H}, o) : at::Tensor();
  const at::Tensor h0 = at::randn({B, H}, o);

  at::Tensor out = at::full({T, B, DH}, 99.0, o), gates = at::empty({T, B, 4 * H}, o);
  SeqForward<double> f;
  f.steps = T, f.batch = B, f.hidden = H, f.reverse = c.reverse;
  f.x_proj = x_proj.data_ptr<double>(), f.w_hh = w_hh.data_ptr<double>();
  f.b_ih = c.biases ? b_ih.data_ptr<double>() : nullptr;
  f.b_hh = c.biases ? b_hh.data_ptr<double>() : nullptr;
  f.h0 = h0.data_ptr<double>(), f.out = out.data_ptr<double>() + col;
  f.out_row = DH, f.out_step = B * DH, f.gates = gates.data_ptr<double>();
  std::mt19937 gen(3);
  emulate_forward<double, double>(f, fwd, gen);

  // Forward: h_t in the direction's columns, the others untouched.
  const at::Tensor xr = x_proj.clone().requires_grad_(), wr = w_hh.clone().requires_grad_();
  const at::Tensor bhr = c.biases ? b_hh.clone().requires_grad_() : at::Tensor();
  const at::Tensor h0r = h0.clone().requires_grad_();
  const at::Tensor ref = reference_forward(xr, wr, b_ih, bhr, h0r, c.reverse);
  EXPECT_TRUE(at::allclose(out.narrow(2, col, H), ref, 1e-12, 1e-12));
  if (c.column_slot) EXPECT_TRUE(at::all(out.narrow(2, 0, H) == 99.0).item<bool>());

  // Backward from random dL/dh_t and dL/dh_n.
  const at::Tensor g_out = at::randn({T, B, DH}, o), g_hn = at::randn({B, H}, o);
  const at::Tensor h_n = ref[c.reverse ? 0 : T - 1];
  ((ref * g_out.narrow(2, col, H)).sum() + (h_n * g_hn).sum()).backward();
  at::Tensor dx = at::full({T, B, 3 * H}, 99.0, o), dhp = at::full({T, B, 3 * H}, 99.0, o);
  at::Tensor dh = g_hn.clone();
  SeqBackward<double> b;
  b.steps = T, b.batch = B, b.hidden = H, b.reverse = c.reverse, b.w_hh = w_hh.data_ptr<double>();
  b.grad_out = g_out.data_ptr<double>() + col, b.grad_out_row = DH, b.grad_out_step = B * DH;
  b.gates = gates.data_ptr<double>(), b.h0 = h0.data_ptr<double>();
  b.out = out.data_ptr<double>() + col, b.out_row = DH, b.out_step = B * DH;
  b.dx_proj = dx.data_ptr<double>(), b.dh_proj = dhp.data_ptr<double>(),
  b.dh = dh.data_ptr<double>();
  emulate_backward<double, double>(b, bwd, gen);

  EXPECT_TRUE(at::allclose(dx, xr.grad(), 1e-11, 1e-11));
  EXPECT_TRUE(at::allclose(dh, h0r.grad(), 1e-11, 1e-11));
  // dh_proj through what the driver makes of it: dW_hh = sum_t dh_proj[t]^T h_{t-1}.
  at::Tensor dw = at::zeros({3 * H, H}, o);
  for (int64_t step = 0; step < T; ++step) {
    const int64_t t = time_of(step, T, c.reverse);
    const at::Tensor prev = step == 0 ? h0 : ref[time_of(step - 1, T, c.reverse)].detach();
    dw += dhp[t].t().mm(prev);
  }
  EXPECT_TRUE(at::allclose(dw, wr.grad(), 1e-10, 1e-10));
  if (c.biases) EXPECT_TRUE(at::allclose(dhp.sum({0, 1}), bhr.grad(), 1e-10, 1e-10));
}

INSTANTIATE_TEST_SUITE_P(Plans, GruPersistent,
                         ::testing::Values(
                             // 3 blocks of 3, 3 and 1 units; chunks of 2 rows (2 + 1)
                             Case{5, 3, 7, false, true, 3, kH200Smem, false},
                             // one unit per block; shared memory for 4 rows at a time forward
                             // (4 + 2), one backward (2 KiB / 4 KiB of partial sums, 480 B of
                             // weights, 160 B / 480 B a row); reverse, column slot
                             Case{4, 6, 20, true, true, kH200Sms, 5100, true},
                             // one batch row, lanes capped by the reduction length; no biases
                             Case{3, 1, 64, false, false, kH200Sms, kH200Smem, false},
                             // 4 blocks of 9 units, 17 rows (16 + 1); reverse, column slot
                             Case{2, 17, 33, true, true, 4, kH200Smem, true},
                             // one block of 130 units: more tiles than threads (a thread loops)
                             Case{2, 40, 130, false, true, 1, 1 << 30, false}));

// float storage with float accumulation (the CUDA kernel's float32), and
// bfloat16 storage with float accumulation, against the double result.
TEST(GruPersistentTypes, FloatAndBFloat16CloseToDouble) {
  const int64_t T = 6, B = 5, H = 24;
  torch::manual_seed(11);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x_proj = at::randn({T, B, 3 * H}, o), w_hh = at::randn({3 * H, H}, o) * 0.3;
  const at::Tensor b_ih = at::randn({3 * H}, o), b_hh = at::randn({3 * H}, o);
  const at::Tensor h0 = at::randn({B, H}, o);
  const at::Tensor ref = reference_forward(x_proj, w_hh, b_ih, b_hh, h0, false);
  auto run = [&](auto tag, at::ScalarType dtype) {
    using T_ = decltype(tag);
    const at::Tensor xs = x_proj.to(dtype), ws = w_hh.to(dtype), bi = b_ih.to(dtype),
                     bh = b_hh.to(dtype), hs = h0.to(dtype);
    at::Tensor out = at::empty({T, B, H}, xs.options());
    SeqForward<T_> f;
    f.steps = T, f.batch = B, f.hidden = H;
    f.x_proj = xs.data_ptr<T_>(), f.w_hh = ws.data_ptr<T_>(), f.b_ih = bi.data_ptr<T_>();
    f.b_hh = bh.data_ptr<T_>(), f.h0 = hs.data_ptr<T_>(), f.out = out.data_ptr<T_>();
    f.out_row = H, f.out_step = B * H;
    const Plan plan = make_plan(H, B, sizeof(T_), sizeof(float), 5, kH200Smem, false);
    std::mt19937 gen(5);
    emulate_forward<T_, float>(f, plan, gen);
    return out.to(at::kDouble);
  };
  EXPECT_TRUE(at::allclose(run(float{}, at::kFloat), ref, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(run(c10::BFloat16{}, at::kBFloat16), ref, 0, 6e-2));
}

// copy_cells: thread th copies cells th, th + kThreads, ... in that order
// (loads in that order, and each store after its load), as the division it
// replaces would give them, each cell once: grids narrower and wider than
// the block, a multiple of it, a column or none, a ragged last batch.
TEST(GruPersistentCells, EachCellOnceInThreadOrder) {
  for (int cols : {1, 2, 3, 63, 64, 100, 511, 512, 513, 1024, 1500, 3072}) {
    for (int rows : {0, 1, 5, 16}) {
      const int64_t n = int64_t{rows} * cols;
      std::vector<int64_t> copied(static_cast<size_t>(n), -1);
      for (int th = 0; th < kThreads; ++th) {
        int64_t next_load = th, next_store = th;
        copy_cells(
            rows, cols, th,
            [&](int r, int c) {
              EXPECT_EQ(int64_t{r} * cols + c, next_load) << rows << "x" << cols << " th " << th;
              next_load += kThreads;
              return int64_t{r} * cols + c;
            },
            [&](int r, int c, int64_t v) {
              EXPECT_EQ(int64_t{r} * cols + c, next_store) << rows << "x" << cols << " th " << th;
              EXPECT_LT(next_store, next_load);
              next_store += kThreads;
              ASSERT_TRUE(r >= 0 && r < rows && c >= 0 && c < cols);
              EXPECT_EQ(copied[static_cast<size_t>(v)], -1) << "cell " << v << " twice";
              copied[static_cast<size_t>(v)] = v;
            });
        EXPECT_GE(next_store, n) << rows << "x" << cols << " thread " << th;
      }
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(copied[static_cast<size_t>(i)], i);
    }
  }
}

// What the H200 gets: one block per SM at most, whole weights on chip.
TEST(GruPersistentPlan, H200Limits) {
  const Plan f1024 = make_plan(1024, 16, 4, 4, kH200Sms, kH200Smem, false);
  EXPECT_EQ(f1024.blocks, 128);
  EXPECT_EQ(f1024.units, 8);
  EXPECT_EQ(f1024.chunk, 16);
  EXPECT_LE(f1024.smem_bytes, kH200Smem);
  const Plan b1024 = make_plan(1024, 64, 4, 4, kH200Sms, kH200Smem, true);
  EXPECT_EQ(b1024.blocks, 128);
  EXPECT_GE(b1024.chunk, 2);  // 3*hidden per staged row: fewer rows at once
  EXPECT_LE(b1024.smem_bytes, kH200Smem);
  // hidden 2048: float's slab (16 units x 3 x 2048 x 4 B = 384 KiB) does not
  // fit a block; bfloat16's does.
  EXPECT_EQ(make_plan(2048, 4, 4, 4, kH200Sms, kH200Smem, false).blocks, 0);
  EXPECT_EQ(make_plan(2048, 4, 2, 4, kH200Sms, kH200Smem, false).blocks, 128);
  const Plan b2048 = make_plan(2048, 4, 2, 4, kH200Sms, kH200Smem, true);
  EXPECT_EQ(b2048.blocks, 128);  // with fewer lanes than fill the block: their sums fit
  EXPECT_EQ(b2048.lanes, 32);
  // 8 tiles a warp apart by 4 rows: a stride of 1028 puts them on banks of their own
  EXPECT_EQ(f1024.lanes, 16);
  EXPECT_EQ(f1024.ld, 1028);
  // Small problems: one unit per block, chunk no larger than the batch.
  const Plan small = make_plan(64, 3, 4, 4, kH200Sms, kH200Smem, false);
  EXPECT_EQ(small.blocks, 64);
  EXPECT_EQ(small.units, 1);
  EXPECT_EQ(small.chunk, 2);
  EXPECT_EQ(make_plan(64, 0, 4, 4, kH200Sms, kH200Smem, false).blocks, 0);
}

}  // namespace
}  // namespace ddpx::detail::persist
