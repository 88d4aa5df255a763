// The GRU gate math of kernels/common/gru_cell.h, driven from C++:
//  - one element against the plain textbook formula and finite differences,
//  - a whole step through the CUDA kernel's grid mapping (emulated on the CPU,
//    grid-stride loop included) against the plain formula,
//  - the vectorized CPU gate step of every instruction set this CPU has
//    against the element function, over odd hidden sizes (vector tails),
//  - the public C++ entry ddpx::fused_gru (dispatcher + autograd) against
//    ATen's at::gru with the same flat weights.
#include <ATen/ATen.h>
#include <ddpx/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/gru_cell.h"
#include "kernels/cpu/fused_gru_gates.h"

namespace ddpx::detail {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// h' = (1 - z) n + z h with nn.GRU's gates, as in the PyTorch documentation.
double plain_gru(double xr, double xz, double xn, double hr, double hz, double hn, double h) {
  const double r = sigmoid(xr + hr);
  const double z = sigmoid(xz + hz);
  const double n = std::tanh(xn + r * hn);
  return (1 - z) * n + z * h;
}

std::vector<double> random_values(size_t n, unsigned seed, double scale = 2.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

TEST(GruCell, ForwardMatchesPlainFormula) {
  const std::vector<double> v = random_values(7 * 200, 1, 4.0);
  for (size_t i = 0; i < v.size(); i += 7) {
    GruGates<double> g;
    const double h = gru_cell_forward<double>(v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4],
                                              v[i + 5], v[i + 6], g);
    EXPECT_NEAR(h, plain_gru(v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6]),
                1e-14);
    EXPECT_DOUBLE_EQ(g.hn, v[i + 5]);
  }
}

TEST(GruCell, FloatForwardMatchesDouble) {
  const std::vector<double> v = random_values(7 * 100, 2, 4.0);
  for (size_t i = 0; i < v.size(); i += 7) {
    GruGates<float> g;
    const float h = gru_cell_forward<float>(v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5],
                                            v[i + 6], g);
    EXPECT_NEAR(h, plain_gru(v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6]),
                1e-6);
  }
}

// Every partial derivative of h' against central differences of the formula.
TEST(GruCell, BackwardMatchesFiniteDifferences) {
  const double eps = 1e-6;
  const std::vector<double> v = random_values(8 * 100, 3);
  for (size_t i = 0; i < v.size(); i += 8) {
    double a[7] = {v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6]};
    const double dh_new = v[i + 7];
    GruGates<double> g;
    gru_cell_forward<double>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], g);
    const GruGateGrads<double> d = gru_cell_backward<double>(dh_new, g, a[6]);
    double numeric[7];
    for (int k = 0; k < 7; ++k) {
      double up[7], down[7];
      std::copy(a, a + 7, up);
      std::copy(a, a + 7, down);
      up[k] += eps;
      down[k] -= eps;
      numeric[k] = dh_new *
                   (plain_gru(up[0], up[1], up[2], up[3], up[4], up[5], up[6]) -
                    plain_gru(down[0], down[1], down[2], down[3], down[4], down[5], down[6])) /
                   (2 * eps);
    }
    // d/dx_r == d/dh_r and d/dx_z == d/dh_z: the kernels store the same value.
    EXPECT_NEAR(d.dxr, numeric[0], 1e-8);
    EXPECT_NEAR(d.dxz, numeric[1], 1e-8);
    EXPECT_NEAR(d.dxn, numeric[2], 1e-8);
    EXPECT_NEAR(d.dxr, numeric[3], 1e-8);
    EXPECT_NEAR(d.dxz, numeric[4], 1e-8);
    EXPECT_NEAR(d.dhn, numeric[5], 1e-8);
    EXPECT_NEAR(d.dh_direct, numeric[6], 1e-8);
  }
}

// ---- one step over [batch, hidden], with strided rows like the driver's ----

struct StepShape {
  int64_t batch, hidden, out_stride;  // out_stride >= hidden: bidirectional layer outputs
};

std::string shape_name(const StepShape& s) {
  return "B" + std::to_string(s.batch) + "_H" + std::to_string(s.hidden) + "_stride" +
         std::to_string(s.out_stride);
}

// Buffers of one step in T, filled with reproducible values.
template <typename T>
struct StepBuffers {
  StepShape s;
  std::vector<T> x_proj, h_proj, b_hh, b_ih, h_prev, h_out, gates;  // forward
  std::vector<T> grad_out, dh, dx_proj, dh_proj, bias_grad;         // backward

  explicit StepBuffers(StepShape shape) : s(shape) {
    const size_t B = s.batch, H = s.hidden, S = s.out_stride;
    auto fill = [](std::vector<T>& v, size_t n, unsigned seed) {
      const std::vector<double> r = random_values(n, seed);
      v.assign(r.begin(), r.end());
    };
    fill(x_proj, B * 3 * H, 10);
    fill(h_proj, B * 3 * H, 11);
    fill(b_hh, 3 * H, 12);
    fill(b_ih, 3 * H, 16);
    fill(h_prev, B * S, 13);
    fill(grad_out, B * S, 14);
    fill(dh, B * H, 15);
    h_out.assign(B * S, T(0));
    gates.assign(B * 4 * H, T(0));
    dx_proj.assign(B * 3 * H, T(0));
    dh_proj.assign(B * 3 * H, T(0));
    bias_grad.assign(4 * H, T(7));  // stale values: the kernel must overwrite them
  }

  GruForwardStep<T> forward() {
    return {s.batch,      s.hidden,     x_proj.data(), 3 * s.hidden,  h_proj.data(),
            3 * s.hidden, b_hh.data(),  b_ih.data(),   h_prev.data(), s.out_stride,
            h_out.data(), s.out_stride, gates.data()};
  }
  GruBackwardStep<T> backward() {
    return {s.batch,        s.hidden,       grad_out.data(), s.out_stride,
            dh.data(),      gates.data(),   h_prev.data(),   s.out_stride,
            dx_proj.data(), dh_proj.data(), bias_grad.data()};
  }
};

// Runs the CUDA kernel's loop on the CPU: every (block, thread) of a grid
// capped at max_blocks, grid-stride, and counts the visits of each element.
template <typename Fn>
std::vector<int> emulate_grid(int64_t batch, int64_t hidden, int64_t threads, int64_t max_blocks,
                              Fn&& element) {
  const int64_t n = batch * hidden;
  const int64_t blocks = gru_grid_blocks(n, threads, max_blocks);
  std::vector<int> visits(n, 0);
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t thread = 0; thread < threads; ++thread) {
      for (int64_t i = block * threads + thread; i < n; i += blocks * threads) {
        const GruElement e = gru_element(i, hidden);
        ++visits[e.row * hidden + e.col];
        element(e.row, e.col);
      }
    }
  }
  return visits;
}

class GruStep : public ::testing::TestWithParam<StepShape> {};

TEST_P(GruStep, CudaGridMappingMatchesPlainFormula) {
  const StepShape s = GetParam();
  StepBuffers<double> buf(s);
  const GruForwardStep<double> p = buf.forward();
  // 32 threads and at most 3 blocks: most shapes need the grid-stride loop.
  const std::vector<int> visits = emulate_grid(
      s.batch, s.hidden, 32, 3, [&](int64_t r, int64_t c) { gru_step_forward_element(p, r, c); });
  const int64_t H = s.hidden;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t j = 0; j < H; ++j) {
      ASSERT_EQ(visits[b * H + j], 1) << "element (" << b << ", " << j << ")";
      const double* x = &buf.x_proj[b * 3 * H + j];
      const double* hp = &buf.h_proj[b * 3 * H + j];
      const double want =
          plain_gru(x[0] + buf.b_ih[j], x[H] + buf.b_ih[H + j], x[2 * H] + buf.b_ih[2 * H + j],
                    hp[0] + buf.b_hh[j], hp[H] + buf.b_hh[H + j], hp[2 * H] + buf.b_hh[2 * H + j],
                    buf.h_prev[b * s.out_stride + j]);
      EXPECT_NEAR(buf.h_out[b * s.out_stride + j], want, 1e-14);
    }
    // Columns past hidden belong to the other direction: untouched.
    for (int64_t j = H; j < s.out_stride; ++j) EXPECT_EQ(buf.h_out[b * s.out_stride + j], 0.0);
  }

  // Backward through the same mapping against the element math called directly.
  std::vector<double> dh_in = buf.dh;
  const GruBackwardStep<double> q = buf.backward();
  const std::vector<int> back_visits = emulate_grid(
      s.batch, s.hidden, 32, 3, [&](int64_t r, int64_t c) { gru_step_backward_element(q, r, c); });
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t j = 0; j < H; ++j) {
      ASSERT_EQ(back_visits[b * H + j], 1);
      const double* g = &buf.gates[b * 4 * H + j];
      const GruGates<double> gates{g[0], g[H], g[2 * H], g[3 * H]};
      const GruGateGrads<double> d =
          gru_cell_backward<double>(dh_in[b * H + j] + buf.grad_out[b * s.out_stride + j], gates,
                                    buf.h_prev[b * s.out_stride + j]);
      EXPECT_EQ(buf.dx_proj[b * 3 * H + j], d.dxr);
      EXPECT_EQ(buf.dx_proj[b * 3 * H + H + j], d.dxz);
      EXPECT_EQ(buf.dx_proj[b * 3 * H + 2 * H + j], d.dxn);
      EXPECT_EQ(buf.dh_proj[b * 3 * H + j], d.dxr);
      EXPECT_EQ(buf.dh_proj[b * 3 * H + H + j], d.dxz);
      EXPECT_EQ(buf.dh_proj[b * 3 * H + 2 * H + j], d.dhn);
      EXPECT_EQ(buf.dh[b * H + j], d.dh_direct);
    }
  }
}

// The vectorized CPU step of one instruction set against the element function.
template <typename T>
void check_cpu_gates(const StepShape& s, void (*fwd)(const GruForwardStep<T>&),
                     void (*bwd)(const GruBackwardStep<T>&), double tol) {
  StepBuffers<T> vec(s), ref(s);
  fwd(vec.forward());
  const GruForwardStep<T> rp = ref.forward();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t j = 0; j < s.hidden; ++j) gru_step_forward_element(rp, b, j);
  }
  for (size_t i = 0; i < vec.h_out.size(); ++i) EXPECT_NEAR(vec.h_out[i], ref.h_out[i], tol) << i;
  for (size_t i = 0; i < vec.gates.size(); ++i) EXPECT_NEAR(vec.gates[i], ref.gates[i], tol) << i;

  bwd(vec.backward());
  const GruBackwardStep<T> rq = ref.backward();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t j = 0; j < s.hidden; ++j) gru_step_backward_element(rq, b, j);
  }
  for (size_t i = 0; i < vec.dx_proj.size(); ++i) {
    EXPECT_NEAR(vec.dx_proj[i], ref.dx_proj[i], tol) << i;
    EXPECT_NEAR(vec.dh_proj[i], ref.dh_proj[i], tol) << i;
  }
  for (size_t i = 0; i < vec.dh.size(); ++i) EXPECT_NEAR(vec.dh[i], ref.dh[i], tol) << i;

  // The step's bias gradient sums: rows of dx_r, dx_z, dx_n and dh_n.
  const int64_t H = s.hidden;
  for (int64_t j = 0; j < 4 * H; ++j) {
    double want = 0;
    for (int64_t b = 0; b < s.batch; ++b) {
      want += j < 3 * H ? ref.dx_proj[b * 3 * H + j] : ref.dh_proj[b * 3 * H + j - H];
    }
    EXPECT_NEAR(vec.bias_grad[j], want, tol * (1 + s.batch)) << "bias_grad " << j;
  }
}

TEST_P(GruStep, CpuVectorizedMatchesElementMath) {
  struct Build {
    const char* name;
    bool available;
    GruCpuGates gates;
  };
  const Build builds[] = {
      {"default", true, gru_cpu_gates_default()},
      {"avx2", __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
       gru_cpu_gates_avx2()},
      {"avx512",
       __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"),
       gru_cpu_gates_avx512()},
  };
  for (const Build& build : builds) {
    if (!build.available) continue;
    SCOPED_TRACE(build.name);
    // Sleef's vector exp/tanh are within 1 ulp; the scalar path uses libm.
    check_cpu_gates<float>(GetParam(), build.gates.forward_f32, build.gates.backward_f32, 2e-6);
    check_cpu_gates<double>(GetParam(), build.gates.forward_f64, build.gates.backward_f64, 1e-14);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GruStep,
                         ::testing::Values(StepShape{1, 1, 1}, StepShape{1, 7, 14},
                                           StepShape{3, 8, 8}, StepShape{2, 17, 34},
                                           StepShape{5, 33, 33}, StepShape{17, 97, 194},
                                           StepShape{4, 64, 64}),
                         [](const auto& info) { return shape_name(info.param); });

// ---- the public C++ entry ------------------------------------------------------------

struct EntryCase {
  int64_t layers;
  bool bidirectional, batch_first, bias;
};

class FusedGruEntry : public ::testing::TestWithParam<EntryCase> {};

TEST_P(FusedGruEntry, MatchesAtGruWithGradients) {
  const EntryCase c = GetParam();
  torch::manual_seed(0);
  const int64_t T = 4, B = 3, I = 5, H = 6, D = c.bidirectional ? 2 : 1;
  const auto opts = torch::dtype(torch::kFloat64);
  std::vector<at::Tensor> params;
  for (int64_t l = 0; l < c.layers; ++l) {
    for (int64_t d = 0; d < D; ++d) {
      params.push_back(torch::randn({3 * H, l == 0 ? I : D * H}, opts).requires_grad_());
      params.push_back(torch::randn({3 * H, H}, opts).requires_grad_());
      if (c.bias) {
        params.push_back(torch::randn({3 * H}, opts).requires_grad_());
        params.push_back(torch::randn({3 * H}, opts).requires_grad_());
      }
    }
  }
  const at::Tensor x =
      torch::randn(c.batch_first ? at::IntArrayRef{B, T, I} : at::IntArrayRef{T, B, I}, opts)
          .requires_grad_();
  const at::Tensor hx = torch::randn({c.layers * D, B, H}, opts).requires_grad_();

  auto [y, h] =
      ddpx::fused_gru(x, hx, params, c.bias, c.layers, 0.0, false, c.bidirectional, c.batch_first);
  auto [y_ref, h_ref] =
      at::gru(x, hx, params, c.bias, c.layers, 0.0, false, c.bidirectional, c.batch_first);
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-9, 1e-10));
  EXPECT_TRUE(torch::allclose(h, h_ref, 1e-9, 1e-10));

  std::vector<at::Tensor> wrt = {x, hx};
  wrt.insert(wrt.end(), params.begin(), params.end());
  const at::Tensor gy = torch::randn_like(y), gh = torch::randn_like(h);
  const auto g = torch::autograd::grad({(y * gy).sum() + (h * gh).sum()}, wrt);
  const auto g_ref = torch::autograd::grad({(y_ref * gy).sum() + (h_ref * gh).sum()}, wrt);
  ASSERT_EQ(g.size(), g_ref.size());
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_TRUE(torch::allclose(g[i], g_ref[i], 1e-9, 1e-10)) << "gradient " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, FusedGruEntry,
                         ::testing::Values(EntryCase{1, false, false, true},
                                           EntryCase{2, true, false, true},
                                           EntryCase{3, true, true, false},
                                           EntryCase{2, false, true, false}),
                         [](const auto& info) {
                           const EntryCase& c = info.param;
                           return "L" + std::to_string(c.layers) + (c.bidirectional ? "_bi" : "") +
                                  (c.batch_first ? "_batch_first" : "") + (c.bias ? "" : "_nobias");
                         });

}  // namespace
}  // namespace ddpx::detail

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
