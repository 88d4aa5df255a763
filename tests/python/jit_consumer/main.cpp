// jit_consumer MODEL CASE: runs the scripted MODEL (ddpx.nn modules: their
// code calls the ddpx ops, registered when libddpx.so loads with this
// program) on CASE's `x` and checks the result against CASE's `y`, both
// saved from Python as attributes of a scripted holder module.
#include <ddpx/ddpx.h>
#include <torch/script.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: jit_consumer MODEL CASE\n";
    return 2;
  }
  torch::jit::Module model = torch::jit::load(argv[1]);
  torch::jit::Module c = torch::jit::load(argv[2]);
  model.eval();
  const at::Tensor x = c.attr("x").toTensor(), want = c.attr("y").toTensor();
  const at::Tensor got = model.forward({x}).toTensor();
  const double diff = (got - want).abs().max().item<double>();
  std::cout << "ddpx " << ddpx::version() << ": max |C++ - Python| = " << diff << "\n";
  if (!(diff <= 1e-5)) return 1;
  std::cout << "jit consumer ok\n";
  return 0;
}
