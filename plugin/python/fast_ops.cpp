// ddpx._C: direct Python entries of the ops that are called per layer, per
// step (today tiled_conv2d), for ddpx.ops and ddpx.nn's eager calls.
//
// Why: torch.ops.ddpx.tiled_conv2d(...) matches its Python arguments against
// the schema generically (IValues, overload resolution, __torch_function__
// checks) before it reaches the dispatcher: 7-16 us a call more than this
// binding on our 2-core machine (which comes within 1 us of F.conv2d on a
// 1x1 convolution that both send to ATen), and on CUDA, where
// cuDNN serves a 10-70 us convolution, that host time is the difference
// (bench_results/gpu/2026-11-28-h200: the path rule's cuDNN cases at
// 1.03-1.20 of F.conv2d). This binding converts the arguments itself and
// calls the same dispatcher entry (ddpx::tiled_conv2d: autograd, autocast,
// device kernels, tracing and dispatch modes all still apply). The Python
// side uses it only when no __torch_function__ override or mode is involved
// and neither TorchScript nor torch.compile is compiling the caller: those
// keep torch.ops (plugin/python/ddpx/ops.py, _fast_ok).
#include "plugin/python/fast_ops.h"

#include <ddpx/ops.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <string>

namespace py = pybind11;

namespace ddpx::python {
namespace {

at::Tensor tensor_arg(py::handle obj, const char* name) {
  if (!THPVariable_Check(obj.ptr())) {
    throw py::type_error(std::string("ddpx.ops.tiled_conv2d: ") + name + " must be a Tensor, got " +
                         py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  return THPVariable_Unpack(obj.ptr());
}

int64_t int_arg(py::handle obj, const char* name) {
  // bool is an int subclass in Python; F.conv2d refuses it, so do we.
  if (!PyLong_Check(obj.ptr()) || PyBool_Check(obj.ptr())) {
    throw py::type_error(std::string("ddpx.ops.tiled_conv2d: ") + name + " must be an int, got " +
                         py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  return obj.cast<int64_t>();
}

// F.conv2d's convention: an int, or a sequence of 1 or 2 ints.
std::array<int64_t, 2> pair_arg(py::handle obj, const char* name) {
  if (PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr())) {
    const int64_t v = obj.cast<int64_t>();
    return {v, v};
  }
  if (!PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr())) {
    throw py::type_error(std::string("ddpx.ops.tiled_conv2d: ") + name +
                         " must be an int or 2 ints, got " +
                         py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  const auto seq = py::reinterpret_borrow<py::sequence>(obj);
  const auto n = seq.size();
  if (n != 1 && n != 2) {
    throw py::value_error(std::string("ddpx.ops.tiled_conv2d: ") + name +
                          " must be an int or 2 ints, got " + py::str(obj).cast<std::string>());
  }
  const int64_t a = int_arg(seq[0], name);
  return {a, n == 2 ? int_arg(seq[1], name) : a};
}

at::Tensor tiled_conv2d(py::handle input, py::handle weight, py::handle bias, py::handle stride,
                        py::handle padding, py::handle dilation, py::handle groups) {
  const at::Tensor x = tensor_arg(input, "input");
  const at::Tensor w = tensor_arg(weight, "weight");
  std::optional<at::Tensor> b;
  if (!bias.is_none()) b = tensor_arg(bias, "bias");
  const auto s = pair_arg(stride, "stride");
  const auto p = pair_arg(padding, "padding");
  const auto d = pair_arg(dilation, "dilation");
  const int64_t g = int_arg(groups, "groups");
  // As ATen's generated bindings do: other Python threads run meanwhile.
  py::gil_scoped_release no_gil;
  return ddpx::tiled_conv2d(x, w, b, s, p, d, g);
}

}  // namespace

void install_fast_ops() {
  auto sys_modules = py::module_::import("sys").attr("modules");
  if (sys_modules.contains("ddpx._C")) return;  // a second load of the glue
  auto m = py::reinterpret_steal<py::module_>(PyModule_New("ddpx._C"));
  if (!m) throw py::error_already_set();
  m.attr("__doc__") =
      "Direct entries of ddpx's per-layer ops (the eager path of ddpx.ops and ddpx.nn); "
      "torch.ops.ddpx.* is the scriptable, compilable form of the same ops.";
  m.def("tiled_conv2d", &tiled_conv2d, py::arg("input"), py::arg("weight"), py::arg("bias"),
        py::arg("stride"), py::arg("padding"), py::arg("dilation"), py::arg("groups"),
        "torch.ops.ddpx.tiled_conv2d without the schema matching: stride, padding and "
        "dilation an int or 1-2 ints; plain Tensors only.");
  sys_modules["ddpx._C"] = m;
}

}  // namespace ddpx::python
