// Codec::reduce_scatter_mean_packed (the codecs' sharded form, GradSync's
// shard()) under mpirun, 2 and 3 ranks, over ddpx_mpi and Gloo: fp16/bf16
// give the owner bit for bit its elements of the all-reduce and keep the
// same residuals; int8 does so outside the chunks an owner's start cuts and
// keeps its stated bound inside them; runs that cut tensors, a rank owning
// nothing, an empty input; the codecs without a sharded form, bad runs and
// ranks that disagree are errors on every rank.
#include <c10/util/accumulate.h>
#include <ddpx/codec.h>
#include <gtest/gtest.h>

#include <vector>

#include "codec_test_util.h"

using ddpx::comm::Codec;
using ddpx::comm::make_codec;
using namespace ddpx::test::codec;

namespace {

using Shapes = std::vector<std::vector<int64_t>>;
using Runs = std::vector<Codec::Run>;

// 35 + 17 + 0 + 97 + 1 elements.
const Shapes kShapes{{5, 7}, {17}, {0}, {97}, {1}};
constexpr int64_t kNumel = 150;

// Owner layouts over kNumel elements for `world` ranks: equal cuts (through
// tensors), everything to the last rank, and the middle rank owning nothing
// (with two ranks: rank 1 owning only the last element).
std::vector<Runs> layouts(int world) {
  std::vector<Runs> out;
  Runs even;
  for (int r = 0; r < world; ++r) {
    const int64_t lo = kNumel * r / world, hi = kNumel * (r + 1) / world;
    even.push_back({lo, hi - lo, r});
  }
  out.push_back(even);
  out.push_back({{0, kNumel, world - 1}});
  if (world == 2) {
    out.push_back({{0, 149, 0}, {149, 1, 1}});
  } else {
    out.push_back({{0, 40, 0}, {40, kNumel - 40, 2}});
  }
  return out;
}

class CodecScatter : public OverBackend {
 protected:
  const Codec::Run* mine(const Runs& runs) {
    for (const auto& r : runs) {
      if (r.rank == rank()) return &r;
    }
    return nullptr;
  }
};

// Three calls under one key (error feedback carrying over), float32 and a
// float64 bucket: the owner's part and every residual equal the all-reduce's.
TEST_P(CodecScatter, HalfCodecsGiveTheOwnerItsElementsOfTheAllreduce) {
  for (const char* spec : {"fp16", "bf16"}) {
    for (auto dtype : {at::kFloat, at::kDouble}) {
      for (const auto& runs : layouts(world())) {
        auto whole = make_codec(spec), sharded = make_codec(spec);
        ASSERT_TRUE(sharded->has_scatter());
        for (int call = 0; call < 3; ++call) {
          const auto x = input_of(rank(), 40 + call, {kNumel}, 5.0).to(dtype);
          const auto want = whole->allreduce_mean_packed(x, kShapes, "k", pg());
          const auto got = sharded->reduce_scatter_mean_packed(x, kShapes, runs, "k", pg());
          const Codec::Run* m = mine(runs);
          ASSERT_EQ(got.defined(), m != nullptr) << spec;
          if (m) {
            EXPECT_EQ(got.scalar_type(), dtype);
            EXPECT_TRUE(at::equal(got, want.narrow(0, m->offset, m->numel)))
                << spec << " call " << call << " runs " << runs.size();
          }
          EXPECT_TRUE(at::equal(sharded->residuals().at("k"), whole->residuals().at("k")))
              << spec << " call " << call;
        }
      }
    }
  }
}

// int8 with 7-element chunks: equal to the all-reduce (result and residual)
// except in the chunks an owner's start cuts; there, without error feedback,
// within the stated bound of the true mean (absmax/254 per rank, averaged).
TEST_P(CodecScatter, Int8EqualsTheAllreduceOutsideTheChunksCutByAnOwner) {
  constexpr int64_t chunk = 7;
  for (const auto& runs : layouts(world())) {
    // Elements of the chunks (on each tensor's own grid) cut by a run start.
    auto cut = at::zeros({kNumel}, at::kBool);
    int64_t ts = 0;
    for (const auto& s : kShapes) {
      const int64_t m = c10::multiply_integers(s);
      for (const auto& r : runs) {
        const int64_t o = r.offset - ts;
        if (o > 0 && o < m && o % chunk != 0) {
          const int64_t c0 = o / chunk * chunk;
          cut.narrow(0, ts + c0, std::min(chunk, m - c0)).fill_(true);
        }
      }
      ts += m;
    }
    for (int key_state = 0; key_state < 2; ++key_state) {
      const std::string key = key_state ? "k" : "";
      auto whole = make_codec("int8:7"), sharded = make_codec("int8:7");
      for (int call = 0; call < 3; ++call) {
        const auto x = input_of(rank(), 60 + call, {kNumel}, 3.0);
        const auto want = whole->allreduce_mean_packed(x, kShapes, key, pg());
        const auto got = sharded->reduce_scatter_mean_packed(x, kShapes, runs, key, pg());
        const Codec::Run* m = mine(runs);
        ASSERT_EQ(got.defined(), m != nullptr);
        if (!m) continue;
        const auto keep = cut.narrow(0, m->offset, m->numel).logical_not();
        const auto w = want.narrow(0, m->offset, m->numel);
        EXPECT_TRUE(at::equal(got.masked_select(keep), w.masked_select(keep))) << "call " << call;
        if (!key.empty()) {
          const auto all_keep = cut.logical_not();
          EXPECT_TRUE(at::equal(sharded->residuals().at(key).masked_select(all_keep),
                                whole->residuals().at(key).masked_select(all_keep)));
          continue;
        }
        // The bound, over the whole chunk's absmax (a piece's is at most that).
        auto bound = at::zeros({kNumel}, at::kDouble);
        for (int r = 0; r < world(); ++r) {
          const auto xr = input_of(r, 60 + call, {kNumel}, 3.0).to(at::kDouble);
          int64_t t0 = 0;
          for (const auto& s : kShapes) {
            const int64_t n = c10::multiply_integers(s);
            for (int64_t c = 0; c < n; c += chunk) {
              const int64_t len = std::min(chunk, n - c);
              bound.narrow(0, t0 + c, len) += xr.narrow(0, t0 + c, len).abs().max() / 254;
            }
            t0 += n;
          }
        }
        const auto truth = true_mean(world(), 60 + call, {kNumel}, 3.0);
        const auto err = (got.to(at::kDouble) - truth.narrow(0, m->offset, m->numel)).abs();
        EXPECT_TRUE((err <= bound.narrow(0, m->offset, m->numel) / world() * (1 + 1e-5) + 1e-6)
                        .all()
                        .item<bool>());
      }
    }
  }
}

TEST_P(CodecScatter, CountsTheEncodedBucketAndHandlesAnEmptyOne) {
  auto c = make_codec("fp16");
  const auto before = c->stats();
  const auto runs = layouts(world())[0];
  c->reduce_scatter_mean_packed(input_of(rank(), 1, {kNumel}), kShapes, runs, "", pg());
  const auto after = c->stats();
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, 96 + 2 * kNumel);  // agreement + fp16 bucket
  EXPECT_EQ(after.bytes_raw - before.bytes_raw, 4 * kNumel);
  for (const char* spec : {"fp16", "int8"}) {
    const auto got = make_codec(spec)->reduce_scatter_mean_packed(at::zeros({0}), {{0}}, {}, "e",
                                                                   pg());
    EXPECT_FALSE(got.defined()) << spec;
  }
}

TEST_P(CodecScatter, BadRunsAndCodecsWithoutTheFormAreErrorsOnEveryRank) {
  const auto x = input_of(rank(), 2, {kNumel});
  const int w = world();
  for (const char* spec : {"none", "topk:0.1", "powersgd:2"}) {
    auto c = make_codec(spec);
    EXPECT_FALSE(c->has_scatter()) << spec;
    const auto e = error_of([&] { c->reduce_scatter_mean_packed(x, kShapes, {{0, kNumel, 0}}, "", pg()); });
    EXPECT_NE(e.find("has no reduce-scatter (sharded) form"), std::string::npos) << e;
  }
  auto c = make_codec("fp16");
  const std::vector<std::pair<Runs, std::string>> bad{
      {{{0, 100, 0}}, "the runs hold 100 elements but the packed input has 150"},
      {{{0, 50, 0}, {60, 90, 1}}, "runs must tile the 150 elements in order"},
      {{{0, 50, 1}, {50, 100, 0}}, "ranks must ascend strictly"},
      {{{0, 50, 0}, {50, 100, w}}, "ranks must ascend strictly within [0, " + std::to_string(w)},
  };
  for (const auto& item : bad) {
    const Runs& runs = item.first;  // (clang 14 captures no structured binding)
    const auto e = error_of([&] { c->reduce_scatter_mean_packed(x, kShapes, runs, "", pg()); });
    EXPECT_NE(e.find(item.second), std::string::npos) << e;
  }
  // Ranks that give different runs: the agreement fails on every rank.
  const Runs mine_only{{0, kNumel, rank() == 0 ? 0 : w - 1}};
  const auto e = error_of([&] { c->reduce_scatter_mean_packed(x, kShapes, mine_only, "", pg()); });
  EXPECT_NE(e.find("the ranks disagree on the shape"), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(Backends, CodecScatter, ::testing::Values("ddpx_mpi", "gloo"),
                         [](const auto& info) { return info.param; });

}  // namespace
