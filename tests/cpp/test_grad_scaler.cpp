// ddpx::GradScaler against torch.amp.GradScaler: export_amp_reference.py
// (a ctest fixture) runs Python's scaler over a sequence of gradients with
// infs and NaNs injected at chosen steps and writes what it did; this runs
// ours on the same gradients, with LibTorch's SGD as Python's (foreach off),
// and compares every step bit for bit: whether each optimizer stepped, the
// unscaled gradients, the scale and growth tracker after update(), the
// parameters; then the state_dicts, both ways. (In the GradSync binary, so
// no executable of its own: every rank runs it alike.)
#include <ddpx/amp.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

#include "mpi_test_util.h"

namespace {

c10::IValue at_key(const c10::impl::GenericDict& d, const std::string& key) {
  const auto it = d.find(c10::IValue(key));
  if (it == d.end()) throw std::runtime_error("the reference has no '" + key + "'");
  return it->value();
}

// Bit for bit (NaN == NaN), or both undefined.
void expect_same_bits(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got.contiguous().view(at::kInt), want.contiguous().view(at::kInt)))
      << what << ": got " << got << " want " << want;
}

at::Tensor tensor_or_none(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }

}  // namespace

TEST(GradScaler, EqualsTorchAmpGradScalerStepByStep) {
  const char* path = std::getenv("DDPX_AMP_REFERENCE");
  if (path == nullptr) GTEST_SKIP() << "DDPX_AMP_REFERENCE unset (ctest's fixture writes it)";
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
  const auto ref = torch::pickle_load(bytes).toGenericDict();
  const auto settings = at_key(ref, "settings").toGenericDict();
  ddpx::GradScaler scaler(ddpx::GradScalerOptions()
                              .init_scale(at_key(settings, "init_scale").toDouble())
                              .growth_factor(at_key(settings, "growth_factor").toDouble())
                              .backoff_factor(at_key(settings, "backoff_factor").toDouble())
                              .growth_interval(at_key(settings, "growth_interval").toInt()));
  std::vector<at::Tensor> params;
  for (const auto& t : at_key(ref, "init").toList()) {
    params.push_back(t.get().toTensor().clone().requires_grad_());
  }
  ASSERT_EQ(params.size(), 3u);
  torch::optim::SGD opt_a({params[0], params[1]}, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD opt_b({params[2]}, torch::optim::SGDOptions(0.05));
  scaler.scale(torch::ones({}));  // makes the scale on the CPU, as the script's first scale()
  const auto events = at_key(ref, "events").toList();
  const auto grads = at_key(ref, "grads").toList();
  const auto unscaled = at_key(ref, "unscaled").toList();
  const auto stepped_a = at_key(ref, "stepped_a").toList();
  const auto stepped_b = at_key(ref, "stepped_b").toList();
  const auto scales = at_key(ref, "scale").toList();
  const auto trackers = at_key(ref, "tracker").toList();
  const auto after = at_key(ref, "params").toList();
  int skipped = 0;
  for (size_t t = 0; t < events.size(); ++t) {
    const std::string event = events.get(t).toStringRef();
    SCOPED_TRACE("step " + std::to_string(t) + " " + event);
    const auto g = grads.get(t).toList();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor gi = tensor_or_none(g.get(i));
      params[i].mutable_grad() = gi.defined() ? gi.clone() : at::Tensor();
    }
    if (event == "unscale_first") scaler.unscale_(opt_a);
    EXPECT_EQ(scaler.step(opt_a), stepped_a.get(t).toBool());
    EXPECT_EQ(scaler.step(opt_b), stepped_b.get(t).toBool());
    skipped += stepped_a.get(t).toBool() ? 0 : 1;
    const auto u = unscaled.get(t).toList();
    for (size_t i = 0; i < params.size(); ++i) {
      expect_same_bits(params[i].grad(), tensor_or_none(u.get(i)),
                       "unscaled gradient " + std::to_string(i));
    }
    if (event == "new_scale") {
      scaler.update(512.0);
    } else {
      scaler.update();
    }
    EXPECT_EQ(scaler.get_scale(), scales.get(t).toDouble());
    EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), trackers.get(t).toInt());
    const auto p = after.get(t).toList();
    for (size_t i = 0; i < params.size(); ++i) {
      expect_same_bits(params[i].detach(), p.get(i).toTensor(), "parameter " + std::to_string(i));
    }
  }
  EXPECT_GE(skipped, 2);  // (the sequence does skip)
  // state_dict both ways: ours holds Python's values, and Python's loads.
  const auto want = at_key(ref, "state_dict").toGenericDict();
  const auto mine = scaler.state_dict();
  for (const char* key : {"scale", "growth_factor", "backoff_factor"}) {
    EXPECT_EQ(mine.at(key).toDouble(), at_key(want, key).toDouble()) << key;
  }
  for (const char* key : {"growth_interval", "_growth_tracker"}) {
    EXPECT_EQ(mine.at(key).toInt(), at_key(want, key).toInt()) << key;
  }
  ddpx::GradScaler loaded;
  loaded.load_state_dict(at_key(ref, "state_dict"));
  EXPECT_EQ(loaded.get_scale(), scaler.get_scale());
  EXPECT_EQ(loaded.get_growth_factor(), scaler.get_growth_factor());
  EXPECT_EQ(loaded.get_backoff_factor(), scaler.get_backoff_factor());
  EXPECT_EQ(loaded.get_growth_interval(), scaler.get_growth_interval());
  loaded.scale(torch::ones({}));
  EXPECT_EQ(loaded.state_dict().at("_growth_tracker").toInt(), mine.at("_growth_tracker").toInt());
}

// The door, and the contract's other edges: bad settings name the setting;
// float16 gradients are refused as torch's scaler refuses them; unscale_
// twice, step twice, update with nothing checked, and the scale unused are
// errors; a disabled scaler passes everything through.
TEST(GradScaler, RefusesWhatTorchRefusesAndPassesThroughWhenDisabled) {
  using ddpx::test::error_of;
  using O = ddpx::GradScalerOptions;
  EXPECT_NE(error_of([] { ddpx::GradScaler s(O().growth_factor(1.0)); }).find("growth_factor"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddpx::GradScaler s(O().backoff_factor(1.0)); }).find("backoff_factor"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddpx::GradScaler s(O().growth_interval(0)); }).find("growth_interval"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddpx::GradScaler s(O().init_scale(-1)); }).find("init_scale"),
            std::string::npos);
  at::Tensor w = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt({w}, 0.1);
  ddpx::GradScaler s;
  EXPECT_NE(error_of([&] { s.step(opt); }).find("scaler.scale(loss)"), std::string::npos);
  s.scale(w.sum()).backward();
  s.unscale_(opt);
  EXPECT_NE(error_of([&] { s.unscale_(opt); }).find("already"), std::string::npos);
  EXPECT_TRUE(s.step(opt));
  EXPECT_NE(error_of([&] { s.step(opt); }).find("already"), std::string::npos);
  s.update();
  EXPECT_NE(error_of([&] { s.update(); }).find("no inf checks"), std::string::npos);
  at::Tensor h = torch::ones({4}, at::kHalf).requires_grad_();
  torch::optim::SGD opt_h({h}, 0.1);
  s.scale(h.sum()).backward();
  EXPECT_NE(error_of([&] { s.step(opt_h); }).find("float16 gradient"), std::string::npos);
  ddpx::GradScaler off(O().enabled(false));
  const at::Tensor loss = (w * 3).sum();
  EXPECT_TRUE(off.scale(loss).is_same(loss));
  w.mutable_grad() = torch::full({4}, std::numeric_limits<float>::infinity());
  EXPECT_TRUE(off.step(opt));  // disabled: no check, the step runs
  EXPECT_EQ(off.get_scale(), 1.0);
  EXPECT_TRUE(off.state_dict().empty());
}
