// ddpx::param_ready(t): returns t once its GradSync update has landed
// (Overlap::NextForward, hooks/param_gate.h); t itself when nothing gates
// it. Put before each read of a parameter or buffer by GradSync's graph
// pass; no autograd of its own (the output is the parameter, so its
// gradient goes straight to the parameter's accumulator).
#include <torch/library.h>

#include "hooks/param_gate.h"

namespace {
at::Tensor param_ready(const at::Tensor& t) {
  ddpx::hooks::wait_gate(t);
  return t;
}

// For Optional[Tensor] attributes (a conv's bias).
std::optional<at::Tensor> param_ready_optional(const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) ddpx::hooks::wait_gate(*t);
  return t;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("param_ready(Tensor(a) self) -> Tensor(a)");
  m.def("param_ready_optional(Tensor(a)? self) -> Tensor(a)?");
}
TORCH_LIBRARY_IMPL(ddpx, CompositeImplicitAutograd, m) {
  m.impl("param_ready", &param_ready);
  m.impl("param_ready_optional", &param_ready_optional);
}
