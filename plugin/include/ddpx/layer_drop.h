#pragma once
// Layer dropping (ddpx-train --layer-drop; torch.ops.ddpx.layer_drop_scales
// for Python and TorchScript): which blocks of a model a step keeps, and the
// scale of the kept ones' residual branches.
//
// The pattern of step t is a pure function of (seed, t, block): a Philox
// counter-based draw (ATen's Philox4_32, the generator of its dropout on
// CUDA), with the step as the subsequence and the block as the offset. Every
// rank, and a run resumed at step t, draws the same pattern with no
// communication, so a block is dropped on every rank at once: GradSync is
// told (declare_unused) and its gradients never go on the wire. The
// per-rank pattern draws from stream rank + 1 instead (LayerDrop's own
// semantics under data parallelism: each rank drops its own blocks and the
// average includes the zeros of the ranks that dropped one), for comparison.
//
// Keep probabilities of block l = 1..L at step t (0-based):
//   constant:P          1 - P                         (LayerDrop, Fan et al. 2019)
//   stochastic-depth:P  1 - (l / L) P                 (Huang et al. 2016, linear decay)
//   pld:THETA           1 - (l / L) (1 - theta(t)),   (Progressive Layer Dropping,
//                       theta(t) = (1 - THETA) exp(-gamma t) + THETA   Zhang & He 2020)
// A kept block's residual branches are scaled by 1/keep-probability
// (scale "inverse", DropPath's convention: evaluation, with every block at 1,
// sees the expected training-time network), or by 1 (scale "none", as
// fairseq's LayerDrop).
#include <cstdint>
#include <string>
#include <vector>

namespace ddpx {

struct LayerDrop {
  enum class Schedule { None, Constant, StochasticDepth, Progressive };
  Schedule schedule = Schedule::None;
  double rate = 0;       // Constant, StochasticDepth: a drop probability; Progressive: theta-bar
  double gamma = 0.001;  // Progressive: how fast theta falls to theta-bar, per step
  bool per_rank = false;
  bool rescale = true;
  uint64_t seed = 1;

  bool active() const { return schedule != Schedule::None; }
  // Of block `block` (0-based) of `depth`, at step `step` (0-based).
  double keep_probability(int64_t step, int block, int depth) const;
  // Per block: 0 if the step drops it, else its residual scale.
  std::vector<double> scales(int64_t step, int depth, int rank) const;
  // The schedule in one line (the flags' values), for logs and checkpoints:
  // a resumed run must continue the same one.
  std::string describe() const;
};

// From a schedule SPEC (none | constant:P | stochastic-depth:P | pld:THETA),
// PLD's gamma, a pattern (shared | per-rank), a scale (inverse | none) and
// the seed -- ddpx-train's --layer-drop, --pld-gamma, --layer-drop-pattern,
// --layer-drop-scale and --seed; throws naming the flag on a bad value.
LayerDrop parse_layer_drop(const std::string& spec, double gamma, const std::string& pattern,
                           const std::string& scale, uint64_t seed);

// A uniform draw in [0, 1) from (seed, step, block, stream): the same
// everywhere for the same arguments.
double drop_uniform(uint64_t seed, int64_t step, int block, uint64_t stream);

}  // namespace ddpx
