#include "plugin/comm/mpi_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <mutex>

#include "plugin/comm/mpi_env.h"

namespace ddpx::comm::detail {
namespace {

// Elementwise reductions for the 2-byte float types: widen, combine, narrow.
struct Sum { static float f(float a, float b) { return a + b; } };
struct Prod { static float f(float a, float b) { return a * b; } };
struct Min { static float f(float a, float b) { return std::min(a, b); } };
struct Max { static float f(float a, float b) { return std::max(a, b); } };

template <typename T, typename Op>
void reduce_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = T(Op::f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct HalfTypes {
  MPI_Datatype half = MPI_DATATYPE_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Op half_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bf16_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

template <typename T>
void make_ops(MPI_Op* ops) {
  DDPX_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Sum>, /*commute=*/1, &ops[0]));
  DDPX_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Prod>, /*commute=*/1, &ops[1]));
  DDPX_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Min>, /*commute=*/1, &ops[2]));
  DDPX_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Max>, /*commute=*/1, &ops[3]));
}

const HalfTypes& half_types() {
  static HalfTypes t = [] {
    MpiEnv::get();
    HalfTypes h;
    // Two distinct committed types so a reduction never mixes them up.
    DDPX_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &h.half));
    DDPX_MPI_CHECK(MPI_Type_commit(&h.half));
    DDPX_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &h.bf16));
    DDPX_MPI_CHECK(MPI_Type_commit(&h.bf16));
    make_ops<c10::Half>(h.half_ops);
    make_ops<c10::BFloat16>(h.bf16_ops);
    return h;
  }();
  return t;
}

int half_op_index(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      return 0;
    case c10d::ReduceOp::PRODUCT:
      return 1;
    case c10d::ReduceOp::MIN:
      return 2;
    case c10d::ReduceOp::MAX:
      return 3;
    default:
      return -1;
  }
}

const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

}  // namespace

MPI_Datatype mpi_datatype(at::ScalarType dtype, const char* arg) {
  switch (dtype) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kHalf: return half_types().half;
    case at::kBFloat16: return half_types().bf16;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kBool: return MPI_C_BOOL;
    default:
      TORCH_CHECK(false, "ddpx_mpi: ", arg, " has dtype ", dtype,
                  ", which is not supported; supported: float32, float64, float16, bfloat16, "
                  "int8, uint8, int32, int64, bool");
  }
}

bool is_avg(const c10d::ReduceOp& op) { return op.op_ == c10d::ReduceOp::AVG; }

MPI_Op mpi_op(const c10d::ReduceOp& rop, at::ScalarType dtype) {
  const auto op = rop.op_;
  TORCH_CHECK(op != c10d::ReduceOp::PREMUL_SUM && op != c10d::ReduceOp::UNUSED,
              "ddpx_mpi: reduce op ", op_name(op), " is not supported");
  const bool floating = at::isFloatingType(dtype);
  TORCH_CHECK(op != c10d::ReduceOp::AVG || floating,
              "ddpx_mpi: reduce op AVG needs a floating-point tensor, got ", dtype);
  const bool bitwise = op == c10d::ReduceOp::BAND || op == c10d::ReduceOp::BOR ||
                       op == c10d::ReduceOp::BXOR;
  TORCH_CHECK(!bitwise || !floating, "ddpx_mpi: reduce op ", op_name(op),
              " needs an integer or bool tensor, got ", dtype);
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    const auto& h = half_types();
    const int i = half_op_index(op);
    return dtype == at::kHalf ? h.half_ops[i] : h.bf16_ops[i];
  }
  if (dtype == at::kBool) {
    // Sums of booleans are "any", products and minima "all", as Gloo does.
    switch (op) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BOR:
        return MPI_LOR;
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::BAND:
        return MPI_LAND;
      default:
        return MPI_LXOR;
    }
  }
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      return MPI_SUM;
    case c10d::ReduceOp::PRODUCT: return MPI_PROD;
    case c10d::ReduceOp::MIN: return MPI_MIN;
    case c10d::ReduceOp::MAX: return MPI_MAX;
    case c10d::ReduceOp::BAND: return MPI_BAND;
    case c10d::ReduceOp::BOR: return MPI_BOR;
    default: return MPI_BXOR;
  }
}

}  // namespace ddpx::comm::detail
