// ps.h's examples, as they stand there (examples/ps_train.inc and
// ps_colocated.inc), run under mpirun in four ways, the first argument:
//   ddpx    the example's Session initialises MPI (and finalises it at exit)
//   self    this program calls MPI_Init_thread(MPI_THREAD_MULTIPLE) first
//           and MPI_Finalize at the end
//   single  this program calls MPI_Init (MPI_THREAD_SINGLE): the Session
//           must refuse with an error naming MPI_THREAD_MULTIPLE
//   colocated  the colocated example (ddpx starts MPI), np 1, 2 and 3
// With one worker (ps_train at 2 ranks), or colocated at 1 and 2 ranks
// (sync: the mean of 2 equal gradients is the gradient), the trained
// parameters must equal local SGD on the same data bit for bit on every
// rank; otherwise the loss must fall.
// Exits 0 on success, else 1 with "example-FAILED" and why.
#include <ddpx/ps.h>
#include <mpi.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "examples/ps_colocated.inc"
#include "examples/ps_train.inc"

namespace {

int fail(int rank, const std::string& why) {
  std::fprintf(stderr, "rank %d: example-FAILED: %s\n", rank, why.c_str());
  return 1;
}

double loss_of(torch::nn::Linear& m, const at::Tensor& x, const at::Tensor& y) {
  torch::NoGradGuard no_grad;
  return torch::mse_loss(m->forward(x), y).item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ddpx";
  int level = 0, rank = 0, size = 0;
  if (mode == "self") MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
  if (mode == "single") MPI_Init(&argc, &argv);
  torch::manual_seed(0);
  torch::nn::Linear model(5, 1);
  torch::nn::Linear ref(5, 1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      ref->parameters()[i].copy_(model->parameters()[i]);
    }
  }
  const at::Tensor x = torch::randn({16, 5});
  const at::Tensor y = torch::randn({16, 1});
  const int steps = 20;
  if (mode == "single") {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::string err;
    try {
      train(model, x, y, steps);
    } catch (const c10::Error& e) {
      err = e.what_without_backtrace();
    }
    MPI_Finalize();
    if (err.find("needs MPI_THREAD_MULTIPLE") == std::string::npos) {
      return fail(rank, "no clear refusal of MPI_THREAD_SINGLE: '" + err + "'");
    }
    std::printf("rank %d: example-ok (refused: %s)\n", rank, err.c_str());
    return 0;
  }
  const double before = loss_of(model, x, y);
  if (mode == "colocated") {
    train_colocated(model, x, y, steps);
  } else {
    train(model, x, y, steps);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  torch::optim::SGD opt(ref->parameters(), 0.1);
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    opt.step();
  }
  const double after = loss_of(model, x, y);
  if (size == 2 || (mode == "colocated" && size == 1)) {
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      if (!at::equal(model->parameters()[i], ref->parameters()[i])) {
        return fail(rank, "parameter " + std::to_string(i) + " differs from local SGD");
      }
    }
  } else if (!(after < 0.9 * before)) {
    return fail(rank, "loss " + std::to_string(before) + " -> " + std::to_string(after));
  }
  if (mode == "self") MPI_Finalize();
  std::printf("rank %d: example-ok (loss %.4f -> %.4f)\n", rank, before, after);
  return 0;
}
