// ddpx::Autocast (ddpx/amp.h): what torch.autocast's __enter__ and __exit__
// do (torch/amp/autocast_mode.py), as a C++ scope.
#include <ATen/autocast_mode.h>
#include <ddpx/amp.h>

namespace ddpx {

Autocast::Autocast(c10::DeviceType device_type, at::ScalarType dtype, bool enabled)
    : device_(device_type),
      enabled_(enabled),
      was_enabled_(at::autocast::is_autocast_enabled(device_type)),
      was_dtype_(at::autocast::get_autocast_dtype(device_type)) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "ddpx::Autocast: dtype must be "
              "float16 or bfloat16, got ",
              dtype);
  TORCH_CHECK(at::autocast::is_autocast_available(device_type),
              "ddpx::Autocast: this torch "
              "has no autocast for device type ",
              device_type);
  at::autocast::set_autocast_enabled(device_, enabled_);
  at::autocast::set_autocast_dtype(device_, dtype);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // The cast weights are cached for the outermost scope only.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, was_dtype_);
}

}  // namespace ddpx
