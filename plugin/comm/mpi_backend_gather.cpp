// ddpx_mpi: allgather, gather, scatter and all-to-all.
#include <c10/util/irange.h>

#include <algorithm>
#include <numeric>

#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_types.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {
namespace {

// Copies the rows of `flat` ([size * numel]) into `outputs` (one per rank).
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  int64_t offset = 0;
  for (const auto& o : outputs) {
    o.copy_(flat.narrow(0, offset, o.numel()).view(o.sizes()));
    offset += o.numel();
  }
}

at::Tensor flatten_cpu(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> parts;
  parts.reserve(tensors.size());
  for (const auto& t : tensors) parts.push_back(t.reshape(-1).cpu());
  return at::cat(parts);
}

std::vector<int> to_counts(const std::vector<int64_t>& v, int64_t scale, const char* arg) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    TORCH_CHECK(v[i] >= 0, "ddpx_mpi: ", arg, "[", i, "] is negative (", v[i], ")");
    out[i] = to_count(v[i] * scale, arg);
  }
  return out;
}

std::vector<int> displacements(const std::vector<int>& counts) {
  std::vector<int> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

// All-to-all with per-peer counts between `send` and `recv` (host tensors);
// first checks that what rank i sends to j is what j expects from i (a
// mismatch would truncate or overrun).
void alltoallv_checked(MPI_Comm comm, int rank, const at::Tensor& send,
                       const std::vector<int>& scounts, const at::Tensor& recv,
                       const std::vector<int>& rcounts, MPI_Datatype dt) {
  const int n = static_cast<int>(scounts.size());
  const at::Tensor sc = int_array(scounts);
  const at::Tensor expected = int_array(std::vector<int>(n));
  MPI_Request req = MPI_REQUEST_NULL;
  DDPX_MPI_CHECK(MPI_Ialltoall(ints(sc), 1, MPI_INT, ints(expected), 1, MPI_INT, comm, &req));
  await_request(req, {sc, expected});
  const int* got = ints(expected);
  const at::Tensor ok = int_array({std::equal(rcounts.begin(), rcounts.end(), got) ? 1 : 0});
  DDPX_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, ints(ok), 1, MPI_INT, MPI_MIN, comm, &req));
  await_request(req, {ok});
  if (!ints(ok)[0]) {
    std::string detail;
    for (int i = 0; i < n; ++i) {
      if (got[i] != rcounts[i]) {
        detail = "rank " + std::to_string(i) + " sends " + std::to_string(got[i]) +
                 " elements to rank " + std::to_string(rank) + ", which expects " +
                 std::to_string(rcounts[i]);
        break;
      }
    }
    C10_THROW_ERROR(DistBackendError,
                    "ddpx_mpi: alltoall split sizes disagree across ranks" +
                        (detail.empty() ? std::string(" (on another rank)") : ": " + detail));
  }
  const at::Tensor sd = int_array(displacements(scounts));
  const at::Tensor rc = int_array(rcounts);
  const at::Tensor rd = int_array(displacements(rcounts));
  DDPX_MPI_CHECK(MPI_Ialltoallv(send.data_ptr(), ints(sc), ints(sd), dt, recv.data_ptr(), ints(rc),
                                ints(rd), dt, comm, &req));
  await_request(req, {send, sc, sd, recv, rc, rd});
}

}  // namespace

c10::intrusive_ptr<c10d::Work> MpiBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions&) {
  check_dense(output, "output");
  check_dense(input, "input");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ddpx_mpi: output has dtype ",
              output.scalar_type(), " but input has ", input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() * size_, "ddpx_mpi: output must have group size (",
              size_, ") x input elements = ", input.numel() * size_, ", got ", output.numel());
  const int count = to_count(input.numel(), "input");
  to_count(output.numel(), "output");
  MPI_Datatype dt = mpi_datatype(input.scalar_type(), "input");
  at::Tensor out = output;
  at::Tensor in = input;
  return post(c10d::OpType::_ALLGATHER_BASE, {out}, {in}, [=, this](MpiWorker::Progress&) {
    HostView hin(in, /*copy_in=*/true);
    HostView hout(out, /*copy_in=*/false);
    check_agreement(comm_, {11, dtype_id(in), count}, "allgather", describe(in));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Iallgather(hin.ptr(), count, dt, hout.ptr(), count, dt, comm_, &req));
    await_request(req, {hin.host(), hout.host()});
    hout.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions&) {
  check_single(inputs, "inputTensors");
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
              "ddpx_mpi: outputTensors must be one list of group size (", size_, ") tensors");
  const at::Tensor in = inputs[0];
  for (const auto& o : outputs[0]) check_same_dtype_numel(o, in, "outputTensors[0][i]");
  const int count = to_count(in.numel(), "inputTensors[0]");
  to_count(in.numel() * size_, "the gathered result");
  MPI_Datatype dt = mpi_datatype(in.scalar_type(), "inputTensors[0]");
  const std::vector<at::Tensor> outs = outputs[0];
  return post(c10d::OpType::ALLGATHER, outs, inputs, [=, this](MpiWorker::Progress&) {
    HostView hin(in, /*copy_in=*/true);
    at::Tensor flat = at::empty({in.numel() * size_}, in.options().device(at::kCPU));
    check_agreement(comm_, {12, dtype_id(in), count}, "allgather", describe(in));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(
        MPI_Iallgather(hin.ptr(), count, dt, flat.data_ptr(), count, dt, comm_, &req));
    await_request(req, {hin.host(), flat});
    unflatten_into(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::GatherOptions& opts) {
  check_single(inputs, "inputTensors");
  check_rank(opts.rootRank, size_, "rootRank");
  const int root = static_cast<int>(opts.rootRank);
  const at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "ddpx_mpi: on the root, outputTensors must be one list of group size (", size_,
                ") tensors");
    for (const auto& o : outputs[0]) check_same_dtype_numel(o, in, "outputTensors[0][i]");
    outs = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "ddpx_mpi: outputTensors must be empty on a non-root rank");
  }
  const int count = to_count(in.numel(), "inputTensors[0]");
  MPI_Datatype dt = mpi_datatype(in.scalar_type(), "inputTensors[0]");
  return post(c10d::OpType::GATHER, outs, inputs, [=, this](MpiWorker::Progress&) {
    HostView hin(in, /*copy_in=*/true);
    at::Tensor flat;
    if (rank_ == root) flat = at::empty({in.numel() * size_}, in.options().device(at::kCPU));
    check_agreement(comm_, {13, dtype_id(in), count, root}, "gather", describe(in));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Igather(hin.ptr(), count, dt, rank_ == root ? flat.data_ptr() : nullptr,
                               count, dt, root, comm_, &req));
    await_request(req, {hin.host(), flat});
    if (rank_ == root) unflatten_into(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  check_single(outputs, "outputTensors");
  check_rank(opts.rootRank, size_, "rootRank");
  const int root = static_cast<int>(opts.rootRank);
  const at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "ddpx_mpi: on the root, inputTensors must be one list of group size (", size_,
                ") tensors");
    for (const auto& i : inputs[0]) check_same_dtype_numel(i, out, "inputTensors[0][i]");
    ins = inputs[0];
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "ddpx_mpi: inputTensors must be empty on a non-root rank");
  }
  const int count = to_count(out.numel(), "outputTensors[0]");
  MPI_Datatype dt = mpi_datatype(out.scalar_type(), "outputTensors[0]");
  return post(c10d::OpType::SCATTER, outputs, ins, [=, this](MpiWorker::Progress&) {
    HostView hout(out, /*copy_in=*/false);
    at::Tensor flat;
    if (rank_ == root) flat = flatten_cpu(ins);
    check_agreement(comm_, {14, dtype_id(out), count, root}, "scatter", describe(out));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Iscatter(rank_ == root ? flat.data_ptr() : nullptr, count, dt,
                                hout.ptr(), count, dt, root, comm_, &req));
    await_request(req, {flat, hout.host()});
    hout.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions&) {
  check_dense(output, "output");
  check_dense(input, "input");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ddpx_mpi: output has dtype ",
              output.scalar_type(), " but input has ", input.scalar_type());
  // Split sizes count rows (dim 0); empty means an equal split.
  auto splits = [this](const at::Tensor& t, const std::vector<int64_t>& s, const char* arg) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row_numel = rows == 0 ? 0 : t.numel() / rows;
    std::vector<int64_t> v = s;
    if (v.empty()) {
      TORCH_CHECK(rows % size_ == 0, "ddpx_mpi: ", arg, " has ", rows,
                  " rows, not divisible by the group size ", size_);
      v.assign(size_, rows / size_);
    }
    TORCH_CHECK(static_cast<int>(v.size()) == size_, "ddpx_mpi: ", arg, "_split_sizes has ",
                v.size(), " entries, expected the group size ", size_);
    TORCH_CHECK(std::accumulate(v.begin(), v.end(), int64_t{0}) == rows, "ddpx_mpi: ", arg,
                "_split_sizes sum to ", std::accumulate(v.begin(), v.end(), int64_t{0}),
                " but ", arg, " has ", rows, " rows");
    return to_counts(v, row_numel, arg);
  };
  const auto scounts = splits(input, input_split_sizes, "input");
  const auto rcounts = splits(output, output_split_sizes, "output");
  MPI_Datatype dt = mpi_datatype(input.scalar_type(), "input");
  at::Tensor out = output;
  at::Tensor in = input;
  return post(c10d::OpType::ALLTOALL_BASE, {out}, {in}, [=, this](MpiWorker::Progress&) {
    HostView hin(in, /*copy_in=*/true);
    HostView hout(out, /*copy_in=*/false);
    alltoallv_checked(comm_, rank_, hin.host(), scounts, hout.host(), rcounts, dt);
    hout.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions&) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "ddpx_mpi: alltoall needs group size (", size_, ") input and output tensors, got ",
              inputs.size(), " and ", outputs.size());
  std::vector<int> scounts(size_), rcounts(size_);
  for (int i = 0; i < size_; ++i) {
    check_dense(inputs[i], "inputTensors[i]");
    check_dense(outputs[i], "outputTensors[i]");
    TORCH_CHECK(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                    outputs[i].scalar_type() == inputs[0].scalar_type(),
                "ddpx_mpi: alltoall needs one dtype for all tensors");
    scounts[i] = to_count(inputs[i].numel(), "inputTensors[i]");
    rcounts[i] = to_count(outputs[i].numel(), "outputTensors[i]");
  }
  MPI_Datatype dt = mpi_datatype(inputs[0].scalar_type(), "inputTensors");
  const std::vector<at::Tensor> ins = inputs;
  const std::vector<at::Tensor> outs = outputs;
  return post(c10d::OpType::ALLTOALL, outs, ins, [=, this](MpiWorker::Progress&) {
    at::Tensor send = flatten_cpu(ins);
    const int64_t total = std::accumulate(rcounts.begin(), rcounts.end(), int64_t{0});
    at::Tensor recv = at::empty({total}, send.options());
    alltoallv_checked(comm_, rank_, send, scounts, recv, rcounts, dt);
    unflatten_into(recv, outs);
  });
}

}  // namespace ddpx::comm::detail
