#pragma once
// ddpx._C (plugin/python/fast_ops.cpp): installed by the Python glue when
// libddpx.so is loaded into a Python process.

namespace ddpx::python {

// Creates the module ddpx._C in sys.modules (once per process). Needs the GIL.
void install_fast_ops();

}  // namespace ddpx::python
