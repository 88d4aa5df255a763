#pragma once
// Mapping of torch dtypes and c10d reduce ops onto MPI datatypes and ops.
//
// MPI has no float16/bfloat16: both travel as 2-byte opaque types reduced by
// user-defined ops that add in float and round once per step (the same
// rounding NCCL does), so the wire carries 2 bytes per element, not 4.
#include <c10/core/ScalarType.h>
#include <mpi.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace ddpx::comm::detail {

// Throws a c10::Error naming `arg` for dtypes ddpx_mpi does not carry.
MPI_Datatype mpi_datatype(at::ScalarType dtype, const char* arg = "tensor");

// The MPI op for `op` on `dtype`. AVG maps to SUM (the caller divides);
// throws for combinations that have no meaning (e.g. AVG on integers).
MPI_Op mpi_op(const c10d::ReduceOp& op, at::ScalarType dtype);

// Whether `op` is AVG (the caller divides by the group size after the SUM).
bool is_avg(const c10d::ReduceOp& op);

}  // namespace ddpx::comm::detail
