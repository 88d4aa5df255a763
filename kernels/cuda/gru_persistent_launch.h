#pragma once
// Launches of the persistent GRU recurrence (gru_persistent_kernel.cu; the
// plan and phases in kernels/common/gru_persistent.h): the sequence hooks of
// the CUDA kernels' GruStepKernels.
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "kernels/common/gru_persistent.h"

namespace ddpx::detail {

// Whether the persistent kernels serve a (hidden, batch, dtype) problem on
// CUDA device `device`, forward and backward (both plans fit the device's
// shared memory and co-resident blocks). Cached per problem.
bool gru_persistent_serves(int device, int64_t hidden, int64_t batch, c10::ScalarType dtype);

// One direction's whole recurrence in one cooperative launch on the current
// device and stream; false (nothing launched) where it does not serve.
bool gru_persistent_forward(c10::ScalarType dtype, const persist::SeqForward<void>& p);
bool gru_persistent_backward(c10::ScalarType dtype, const persist::SeqBackward<void>& p);

}  // namespace ddpx::detail
