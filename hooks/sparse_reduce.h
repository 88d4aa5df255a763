#pragma once
// Averaging a sparse (COO) gradient across ranks by its rows, as DDP does for
// Embedding(sparse=true): the ranks gather each other's nonzero rows and sum
// them, instead of all-reducing the dense table (a 10M x 64 embedding is
// 2.5 GB dense, of which a step touches a few thousand rows). When the rows
// would cost more than the dense all-reduce (every rank touching much of the
// table), it all-reduces densely instead; every rank sees the same row
// counts first, so all take the same path.
#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddpx::hooks {

struct SparseAverage {
  at::Tensor avg;          // coalesced sparse COO; undefined: no rank had a gradient
  int64_t wire_bytes = 0;  // what this rank put on the wire
};

// The mean over pg's ranks of `local`, a gradient of `param` (shape, dtype
// and device): sparse COO with `sparse_dim` index dimensions (coalesced or
// not), a dense one (sent as its nonzero rows), or undefined (no gradient
// on this rank, which counts as zero). A collective: every rank calls it
// with the same parameter and sparse_dim.
SparseAverage sparse_average(c10d::ProcessGroup& pg, const at::Tensor& local,
                             const at::Tensor& param, int64_t sparse_dim);

}  // namespace ddpx::hooks
