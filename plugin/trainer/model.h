#pragma once
// The scripted model a run trains, and what it says about its input.
#include <torch/script.h>

#include <string>

#include "plugin/trainer/data.h"

namespace ddpx::trainer {

struct ScriptedModel {
  torch::jit::Module module;
  InputSpec spec;  // what forward takes and how many classes it scores
};

// Loads `path` (plugin ops resolve: libddpx is linked) and checks the
// contract of scripts/export_models.py: forward(x) -> logits plus the
// attributes ddpx_input and num_classes (and vocab_size, sentences, words for
// token models; optionally image_shape, [C, H, W], for image models, 1x28x28
// when absent). Throws naming the file and what is missing.
ScriptedModel load_model(const std::string& path);

// Moves the model to `device`. On CUDA, each GRU of the model (ddpx.nn.FusedGRU,
// nn.GRU) then has its weights made views of one buffer in cuDNN's layout, as
// nn.GRU's own move does (flatten_parameters): cuDNN reads such weights in
// place, and copies weights that are not into one, with a warning, on every
// call. The parameters stay the same tensors.
void move_model(torch::jit::Module& model, const at::Device& device);

// Each GRU of the model whose weights cuDNN can take (one CUDA device, a dtype
// at::gru hands to cuDNN): its weights made views of one buffer (ATen's
// _cudnn_rnn_flatten_weight, which nn.GRU's flatten_parameters calls). Also
// after the parameters change dtype in place (GradSync's mixed_precision),
// which leaves each in a buffer of its own.
void flatten_gru_weights(torch::jit::Module& model);

}  // namespace ddpx::trainer
