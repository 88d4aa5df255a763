#pragma once
// The persistent CUDA GRU recurrence (kernels/cuda/gru_persistent_kernel.cu):
// its plan and every phase of a block as __host__ __device__ functions, so
// that tests/cpp/test_gru_persistent.cpp runs every block and thread of a
// launch on the CPU with the code the GPU runs.
//
// Why: the per-step driver (gru_sequence.cpp) launches a GEMM and a gate
// kernel per time step and layer; on the H100/H200 that made ours 2.1-8.6x
// cuDNN at hidden 64 and 0.97-1.21x at 256 (bench_results/gpu/), launch
// bound. A persistent kernel (Diamos et al., "Persistent RNNs", ICML 2016)
// launches once per layer and direction and keeps each block's slice of the
// recurrent weights in shared memory across all time steps.
//
// The work of one (layer, direction), one cooperative launch of `blocks`
// blocks. Block j owns hidden units [j*units, j*units + units_j):
//   forward, per time step (in the direction's order):
//     stage h_{t-1} (a chunk of batch rows at a time) into shared memory;
//     dots: W_hh[rows r, z, n of its units] . h_{t-1}   (3*units_j x chunk, K = hidden)
//     gates: its units' h_t and saved gates (gru_cell.h), to global memory;
//     grid-wide sync (h_t complete for the next step).
//   backward, per time step in reverse, then once more for dL/dh0:
//     stage dh_proj of the step after (all 3*hidden columns, a chunk of rows);
//     dots: (dh_proj W_hh)[its units]    (units_j x chunk, K = 3*hidden);
//     gates: dL/dh_t = carried z*dh' + that + grad_out[t], then the gate
//     gradients of its units into dx_proj[t], dh_proj[t], the carry z*dh_t;
//     grid-wide sync (dh_proj[t] complete for the step before).
// The input projection (one GEMM over all steps) and the weight gradients
// (GEMMs over all steps afterwards) stay with the driver.
//
// Dots: a thread owns a kRows x kCols register tile of outputs and a `lanes`-th
// of the reduction (k = lane, lane + lanes, ...: a warp's lanes read
// consecutive shared-memory words); the lanes' partial sums go through
// shared memory (folded by all threads first where there are many) and are
// added in lane order (deterministic).
#include <cstdint>

#include "kernels/common/gru_cell.h"
#include "kernels/common/host_device.h"

#if defined(__CUDACC__)
#define DDPX_PERSIST_UNROLL _Pragma("unroll")
#else
#define DDPX_PERSIST_UNROLL
#endif

namespace ddpx::detail::persist {

constexpr int kThreads = 512;
constexpr int kRows = 4, kCols = 4;  // a thread's register tile of dot outputs

// Forward: one direction's recurrence. Pointers on the device; T the storage type.
template <typename T>
struct SeqForward {
  int64_t steps = 0, batch = 0, hidden = 0;
  bool reverse = false;
  const T* x_proj = nullptr;  // [steps, batch, 3*hidden] W_ih x_t, without bias
  const T* w_hh = nullptr;    // [3*hidden, hidden] contiguous
  const T* b_ih = nullptr;    // [3*hidden] or nullptr
  const T* b_hh = nullptr;    // [3*hidden] or nullptr
  const T* h0 = nullptr;      // [batch, hidden] contiguous
  T* out = nullptr;           // h_t at out + t*out_step + b*out_row + j
  int64_t out_row = 0, out_step = 0;
  T* gates = nullptr;  // [steps, batch, 4*hidden] (r, z, n, hn) or nullptr
};

// Backward: BPTT through one direction's recurrence.
template <typename T>
struct SeqBackward {
  int64_t steps = 0, batch = 0, hidden = 0;
  bool reverse = false;
  const T* w_hh = nullptr;      // [3*hidden, hidden] contiguous
  const T* grad_out = nullptr;  // dL/dh_t from the layer output, like SeqForward::out
  int64_t grad_out_row = 0, grad_out_step = 0;
  const T* gates = nullptr;  // [steps, batch, 4*hidden] saved by forward
  const T* h0 = nullptr;     // [batch, hidden] contiguous
  const T* out = nullptr;    // h_t of this direction, like SeqForward::out
  int64_t out_row = 0, out_step = 0;
  T* dx_proj = nullptr;  // [steps, batch, 3*hidden]
  T* dh_proj = nullptr;  // [steps, batch, 3*hidden]
  T* dh = nullptr;       // [batch, hidden] contiguous; in: dL/dh_n, out: dL/dh0
};

// How a launch cuts the work; blocks == 0: the persistent kernel does not
// serve this problem (the driver runs its per-step loop).
struct Plan {
  int blocks = 0;
  int units = 0;   // hidden units per block (the last block may own fewer)
  int chunk = 0;   // batch rows staged and reduced at once
  int lanes = 1;   // threads that share one dot tile's reduction
  int64_t ld = 0;  // row stride of the weight slab and staged rows in shared memory
  int64_t smem_bytes = 0;
};

DDPX_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
DDPX_HD int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The reduction length of a block's dots, and the rows of its weight slab.
DDPX_HD int64_t dot_k(int64_t hidden, bool backward) { return backward ? 3 * hidden : hidden; }
DDPX_HD int slab_rows(int units, bool backward) { return backward ? units : 3 * units; }

// The dot phase's split of an m x bc output over the block's threads: tiles
// of kRows x kCols, each reduced by the plan's `lanes` threads.
struct DotSplit {
  int tiles_m = 0, tiles_b = 0, tiles = 0, lanes = 1;
};

DDPX_HD DotSplit dot_split(int m, int bc, int lanes) {
  DotSplit s;
  s.tiles_m = static_cast<int>(ceil_div(m, kRows));
  s.tiles_b = static_cast<int>(ceil_div(bc, kCols));
  s.tiles = s.tiles_m * s.tiles_b;
  s.lanes = lanes;
  return s;
}

// Lanes per tile for a block's full m x chunk output: the most (a power of
// two, at most k) that keep tiles*lanes within kThreads. Fixed per plan: a
// block with fewer units, or a last chunk with fewer rows, has fewer tiles
// with as many lanes, so it never needs more partial sums than the plan
// reserved.
DDPX_HD int plan_lanes(int m, int chunk, int64_t k) {
  const DotSplit s = dot_split(m, chunk, 1);
  int lanes = 1;
  while (s.tiles * lanes * 2 <= kThreads && lanes * 2 <= k) lanes *= 2;
  return lanes;
}

// Row stride (elements) of the weight slab and the staged rows in shared
// memory. With lanes < 32 a warp holds 32/lanes tiles whose rows are kRows
// (or kCols) apart; at a stride that is a multiple of 32 words they would read
// the same banks. A stride with 4*ld = lanes (mod 32) puts each tile's lanes
// on banks of their own (lanes 4..16; lanes 1-2 get 8 distinct offsets).
DDPX_HD int64_t padded_ld(int64_t k, int lanes) {
  static_assert(kRows == 4 && kCols == 4, "the padding rule assumes rows 4 apart");
  if (lanes >= 32) return k;
  const int64_t want = lanes >= 4 ? lanes / 4 : 1;  // ld mod 8
  return k + ((want - k % 8) + 8) % 8;
}

// Shared memory of a block: partial sums ([kRows*kCols][tiles][lanes] of
// acc_size), then the weight slab (slab_rows x ld), then the staged chunk
// (chunk x ld).
struct Layout {
  int64_t red = 0, w = 0, x = 0, bytes = 0;
};

DDPX_HD Layout layout(const Plan& p, bool backward, int elem_size, int acc_size) {
  const DotSplit s = dot_split(slab_rows(p.units, backward), p.chunk, p.lanes);
  Layout l;
  l.red = 0;
  l.w = align16(int64_t{kRows} * kCols * s.tiles * s.lanes * acc_size);
  l.x = l.w + align16(int64_t{slab_rows(p.units, backward)} * p.ld * elem_size);
  l.bytes = l.x + align16(int64_t{p.chunk} * p.ld * elem_size);
  return l;
}

// A block's shared memory cut as `l` says (the kernels' and the emulation's).
template <typename T, typename Acc>
struct Carved {
  Acc* red;
  T* w;
  T* x;
};
template <typename T, typename Acc>
DDPX_HD Carved<T, Acc> carve(unsigned char* base, const Layout& l) {
  return {reinterpret_cast<Acc*>(base + l.red), reinterpret_cast<T*>(base + l.w),
          reinterpret_cast<T*>(base + l.x)};
}

// Batch rows of the chunk starting at row b0.
DDPX_HD int chunk_rows(const Plan& p, int64_t batch, int64_t b0) {
  return static_cast<int>(batch - b0 < p.chunk ? batch - b0 : p.chunk);
}

// The plan for `max_blocks` co-resident blocks (the SMs: one block each) and
// `max_smem` bytes of shared memory per block: as many blocks as give each
// one unit or more, then the largest chunk of batch rows (a power of two, at
// most 64) that fits, with as many lanes as fit (their partial sums take
// shared memory too), down to a warp per tile.
inline Plan make_plan(int64_t hidden, int64_t batch, int elem_size, int acc_size, int max_blocks,
                      int64_t max_smem, bool backward) {
  if (hidden <= 0 || batch <= 0 || max_blocks <= 0) return Plan{};
  const int64_t units = ceil_div(hidden, max_blocks), k = dot_k(hidden, backward);
  if (units > 1024) return Plan{};
  int chunk = 64;
  while (chunk > batch && chunk > 1) chunk /= 2;
  for (; chunk >= 1; chunk /= 2) {
    const int most = plan_lanes(slab_rows(static_cast<int>(units), backward), chunk, k);
    for (int lanes = most; lanes >= (most < 32 ? most : 32); lanes /= 2) {
      Plan c;
      c.units = static_cast<int>(units);
      c.blocks = static_cast<int>(ceil_div(hidden, units));
      c.chunk = chunk;
      c.lanes = lanes;
      c.ld = padded_ld(k, lanes);
      c.smem_bytes = layout(c, backward, elem_size, acc_size).bytes;
      if (c.smem_bytes <= max_smem) return c;
    }
  }
  return Plan{};
}

// Hidden units of block `block`: [first, first + count).
DDPX_HD int units_of(const Plan& p, int64_t hidden, int block) {
  const int64_t first = int64_t{block} * p.units;
  const int64_t left = hidden - first;
  return static_cast<int>(left < p.units ? left : p.units);
}

// Time index of the step-th step of the direction.
DDPX_HD int64_t time_of(int64_t step, int64_t steps, bool reverse) {
  return reverse ? steps - 1 - step : step;
}

// ---- phases (thread `th` of kThreads; each loops over its share) ----------------

// Copies the cells r * cols + c = th, th + kThreads, ... of a rows x cols
// grid (a block's threads walk it in order, consecutive threads on
// consecutive columns): store(r, c, load(r, c)), kCopyBatch cells at a time,
// every load of a batch issued before its first store.
//
// Why: staging is a copy from global memory (L2: what the other blocks wrote
// in the step before) to shared memory, and a loop that stores each value
// before loading the next keeps one load per warp in flight: at batch 16
// and hidden 1024 on the H200, backward stages 96 values per thread per
// time step (2 chunks x 8 rows x 3*1024 / 512 threads) and forward 32, so
// a few hundred cycles of L2 latency each came to tens of microseconds of
// the ~76 us each time step took (fwd + bwd; ours 1.3x cuDNN there, 0.45x
// at batch 1, where it is 2 and 6 values). By our count, not profiled yet.
// And no division per cell: the thread's stride is split once into rows and
// columns (the loops divided a 64-bit index per element, which the
// compiler narrows to a 32-bit divide when the values fit: ~20 instructions).
constexpr int kCopyBatch = 8;

template <typename Load, typename Store>
DDPX_HD void copy_cells(int rows, int cols, int th, Load&& load, Store&& store) {
  using V = decltype(load(0, 0));
  const int dr = kThreads / cols, dc = kThreads % cols;
  int r = th / cols, c = th % cols;
  while (r < rows) {
    V v[kCopyBatch];
    int rs[kCopyBatch], cs[kCopyBatch];
    DDPX_PERSIST_UNROLL
    for (int j = 0; j < kCopyBatch; ++j) {
      rs[j] = r;
      cs[j] = c;
      v[j] = r < rows ? load(r, c) : V();
      r += dr;
      c += dc;
      if (c >= cols) {
        c -= cols;
        ++r;
      }
    }
    DDPX_PERSIST_UNROLL
    for (int j = 0; j < kCopyBatch; ++j) {
      if (rs[j] < rows) store(rs[j], cs[j], v[j]);
    }
  }
}

// Forward, once per launch: the block's rows of W_hh, gate-major: slab row
// g*units_j + u is W_hh row g*hidden + first + u.
template <typename T>
DDPX_HD void load_forward_weights(const SeqForward<T>& p, const Plan& plan, int block, T* w,
                                  int th) {
  const int uj = units_of(plan, p.hidden, block);
  const int64_t first = int64_t{block} * plan.units, H = p.hidden;
  for (int g = 0; g < 3; ++g) {
    copy_cells(
        uj, static_cast<int>(H), th,
        [&](int u, int k) { return p.w_hh[(g * H + first + u) * H + k]; },
        [&](int u, int k, T v) { w[(int64_t{g} * uj + u) * plan.ld + k] = v; });
  }
}

// Backward, once per launch: the block's columns of W_hh, transposed: slab
// row u holds W_hh[:, first + u] (3*hidden elements). (Walked along W_hh's
// rows: consecutive threads read consecutive columns of one row.)
template <typename T>
DDPX_HD void load_backward_weights(const SeqBackward<T>& p, const Plan& plan, int block, T* w,
                                   int th) {
  const int uj = units_of(plan, p.hidden, block);
  const int64_t first = int64_t{block} * plan.units, H = p.hidden;
  copy_cells(
      static_cast<int>(3 * H), uj, th, [&](int k, int u) { return p.w_hh[k * H + first + u]; },
      [&](int k, int u, T v) { w[u * plan.ld + k] = v; });
}

// Rows [b0, b0 + bc) of a [batch, k] matrix at src (row stride `row`) into x
// (row stride ld).
template <typename T>
DDPX_HD void stage_rows(const T* src, int64_t row, int64_t k, int64_t b0, int bc, T* x, int64_t ld,
                        int th) {
  copy_cells(
      bc, static_cast<int>(k), th, [&](int b, int c) { return src[(b0 + b) * row + c]; },
      [&](int b, int c, T v) { x[b * ld + c] = v; });
}

// h_{t-1} of the step-th forward step (h0 at step 0).
template <typename T>
DDPX_HD void stage_forward_chunk(const SeqForward<T>& p, const Plan& plan, int64_t step, int64_t b0,
                                 int bc, T* x, int th) {
  if (step == 0) {
    stage_rows(p.h0, p.hidden, p.hidden, b0, bc, x, plan.ld, th);
    return;
  }
  const int64_t prev = time_of(step - 1, p.steps, p.reverse);
  stage_rows<T>(p.out + prev * p.out_step, p.out_row, p.hidden, b0, bc, x, plan.ld, th);
}

// dh_proj of the step after the step-th backward step (step < steps - 1).
template <typename T>
DDPX_HD void stage_backward_chunk(const SeqBackward<T>& p, const Plan& plan, int64_t step,
                                  int64_t b0, int bc, T* x, int th) {
  const int64_t next = time_of(step + 1, p.steps, p.reverse);
  const int64_t H3 = 3 * p.hidden;
  stage_rows<T>(p.dh_proj + next * p.batch * H3, H3, H3, b0, bc, x, plan.ld, th);
}

// Partial dot products: out[i][b] = sum_k a[i*ld + k] * x[b*ld + k] over
// this thread's lane of k < k_len, for each tile it owns, into red.
template <typename T, typename Acc>
DDPX_HD void dot_phase(const DotSplit& s, int m, int bc, int64_t k_len, int64_t ld, const T* a,
                       const T* x, Acc* red, int th) {
  for (int item = th; item < s.tiles * s.lanes; item += kThreads) {
    const int tile = item / s.lanes, lane = item % s.lanes;
    const int m0 = tile / s.tiles_b * kRows, b0 = tile % s.tiles_b * kCols;
    // Rows and columns past the edge read the last valid one (no branch in
    // the loop); their sums are never read.
    const T* ar[kRows];
    const T* xr[kCols];
    DDPX_PERSIST_UNROLL
    for (int i = 0; i < kRows; ++i) ar[i] = a + (m0 + i < m ? m0 + i : m - 1) * ld;
    DDPX_PERSIST_UNROLL
    for (int j = 0; j < kCols; ++j) xr[j] = x + (b0 + j < bc ? b0 + j : bc - 1) * ld;
    Acc acc[kRows][kCols];
    DDPX_PERSIST_UNROLL
    for (int i = 0; i < kRows; ++i) {
      DDPX_PERSIST_UNROLL
      for (int j = 0; j < kCols; ++j) acc[i][j] = Acc(0);
    }
    // (32-bit: k_len is at most 3 x hidden, and index math in the hot loop)
    const int k_end = static_cast<int>(k_len);
    for (int kk = lane; kk < k_end; kk += s.lanes) {
      Acc av[kRows], xv[kCols];
      DDPX_PERSIST_UNROLL
      for (int i = 0; i < kRows; ++i) av[i] = static_cast<Acc>(ar[i][kk]);
      DDPX_PERSIST_UNROLL
      for (int j = 0; j < kCols; ++j) xv[j] = static_cast<Acc>(xr[j][kk]);
      DDPX_PERSIST_UNROLL
      for (int i = 0; i < kRows; ++i) {
        DDPX_PERSIST_UNROLL
        for (int j = 0; j < kCols; ++j) acc[i][j] += av[i] * xv[j];
      }
    }
    DDPX_PERSIST_UNROLL
    for (int i = 0; i < kRows; ++i) {
      DDPX_PERSIST_UNROLL
      for (int j = 0; j < kCols; ++j) {
        red[((i * kCols + j) * s.tiles + tile) * s.lanes + lane] = acc[i][j];
      }
    }
  }
}

// With many lanes a tile's partial sums are first folded in groups of
// kFold, in place, by all threads at once (a phase of its own): the gate
// phase then adds lanes/kFold values per output instead of `lanes` in a
// row (128 at hidden 1024 backward: a chain of shared-memory loads).
constexpr int kFold = 8;
DDPX_HD bool folds(const DotSplit& s) { return s.lanes >= 4 * kFold; }

// Slot g*kFold of each output's partial sums becomes the sum of lanes
// [g*kFold, (g+1)*kFold), in lane order (folds(s) only).
template <typename Acc>
DDPX_HD void fold_phase(const DotSplit& s, Acc* red, int th) {
  const int groups = s.lanes / kFold;
  const int n = kRows * kCols * s.tiles * groups;
  for (int item = th; item < n; item += kThreads) {
    Acc* r = red + (item / groups) * s.lanes + (item % groups) * kFold;
    Acc sum = r[0];
    DDPX_PERSIST_UNROLL
    for (int l = 1; l < kFold; ++l) sum += r[l];
    r[0] = sum;
  }
}

// The full dot product of output (row, b): its lanes' partial sums (folded
// when folds(s)) in lane order.
template <typename Acc>
DDPX_HD Acc dot_result(const DotSplit& s, const Acc* red, int row, int b) {
  const int tile = row / kRows * s.tiles_b + b / kCols;
  const Acc* r = red + ((row % kRows * kCols + b % kCols) * s.tiles + tile) * s.lanes;
  const int step = folds(s) ? kFold : 1;
  Acc sum = r[0];
  for (int l = step; l < s.lanes; l += step) sum += r[l];
  return sum;
}

// Forward gates of the block's units for batch rows [b0, b0 + bc) of the
// step-th step; x holds those rows of h_{t-1}, red the dots.
template <typename T, typename Acc>
DDPX_HD void forward_gates_phase(const SeqForward<T>& p, const Plan& plan, int block, int64_t step,
                                 int64_t b0, int bc, const T* x, const Acc* red, int th) {
  const int uj = units_of(plan, p.hidden, block);
  const DotSplit s = dot_split(3 * uj, bc, plan.lanes);
  const int64_t H = p.hidden, first = int64_t{block} * plan.units;
  const int64_t t = time_of(step, p.steps, p.reverse);
  for (int item = th; item < uj * bc; item += kThreads) {
    const int u = item % uj, b = item / uj;
    const int64_t j = first + u, row = b0 + b;
    Acc hr = dot_result(s, red, u, b), hz = dot_result(s, red, uj + u, b),
        hn = dot_result(s, red, 2 * uj + u, b);
    if (p.b_hh != nullptr) {
      hr += static_cast<Acc>(p.b_hh[j]);
      hz += static_cast<Acc>(p.b_hh[H + j]);
      hn += static_cast<Acc>(p.b_hh[2 * H + j]);
    }
    const T* xp = p.x_proj + (t * p.batch + row) * 3 * H + j;
    Acc xr = static_cast<Acc>(xp[0]), xz = static_cast<Acc>(xp[H]),
        xn = static_cast<Acc>(xp[2 * H]);
    if (p.b_ih != nullptr) {
      xr += static_cast<Acc>(p.b_ih[j]);
      xz += static_cast<Acc>(p.b_ih[H + j]);
      xn += static_cast<Acc>(p.b_ih[2 * H + j]);
    }
    GruGates<Acc> g;
    const Acc h =
        gru_cell_forward<Acc>(xr, xz, xn, hr, hz, hn, static_cast<Acc>(x[b * plan.ld + j]), g);
    p.out[t * p.out_step + row * p.out_row + j] = static_cast<T>(h);
    if (p.gates != nullptr) {
      T* sv = p.gates + (t * p.batch + row) * 4 * H + j;
      sv[0] = static_cast<T>(g.r);
      sv[H] = static_cast<T>(g.z);
      sv[2 * H] = static_cast<T>(g.n);
      sv[3 * H] = static_cast<T>(g.hn);
    }
  }
}

// Backward gates of the block's units for batch rows [b0, b0 + bc) of the
// step-th step (step == -1: only dL/dh0 = carry + dots into dh). `dots`:
// whether red holds (dh_proj of the step after) . W_hh (false at the last step).
template <typename T, typename Acc>
DDPX_HD void backward_gates_phase(const SeqBackward<T>& p, const Plan& plan, int block,
                                  int64_t step, int64_t b0, int bc, bool dots, const Acc* red,
                                  int th) {
  const int uj = units_of(plan, p.hidden, block);
  const DotSplit s = dot_split(uj, bc, plan.lanes);
  const int64_t H = p.hidden, first = int64_t{block} * plan.units;
  for (int item = th; item < uj * bc; item += kThreads) {
    const int u = item % uj, b = item / uj;
    const int64_t j = first + u, row = b0 + b;
    T* carry = p.dh + row * H + j;
    Acc dh = static_cast<Acc>(*carry);
    if (dots) dh += dot_result(s, red, u, b);
    if (step < 0) {
      *carry = static_cast<T>(dh);
      continue;
    }
    const int64_t t = time_of(step, p.steps, p.reverse);
    dh += static_cast<Acc>(p.grad_out[t * p.grad_out_step + row * p.grad_out_row + j]);
    const T* sv = p.gates + (t * p.batch + row) * 4 * H + j;
    const GruGates<Acc> g{static_cast<Acc>(sv[0]), static_cast<Acc>(sv[H]),
                          static_cast<Acc>(sv[2 * H]), static_cast<Acc>(sv[3 * H])};
    const T* hp =
        step == 0 ? p.h0 + row * H
                  : p.out + time_of(step - 1, p.steps, p.reverse) * p.out_step + row * p.out_row;
    const GruGateGrads<Acc> d = gru_cell_backward<Acc>(dh, g, static_cast<Acc>(hp[j]));
    T* dx = p.dx_proj + (t * p.batch + row) * 3 * H + j;
    T* dhp = p.dh_proj + (t * p.batch + row) * 3 * H + j;
    dx[0] = dhp[0] = static_cast<T>(d.dxr);
    dx[H] = dhp[H] = static_cast<T>(d.dxz);
    dx[2 * H] = static_cast<T>(d.dxn);
    dhp[2 * H] = static_cast<T>(d.dhn);
    *carry = static_cast<T>(d.dh_direct);
  }
}

}  // namespace ddpx::detail::persist
