// ddpx_mpi: the coalesced collectives (several tensors, one MPI call per
// dtype) and the coalescing block (startCoalescing/endCoalescing).
//
// Argument rules follow ProcessGroupGloo's allgather_coalesced and
// all_gather_single_coalesced / reduce_scatter_single_coalesced (the names
// DTensor, FSDP2 and the functional collectives reach through c10d):
//   - all_gather_single_coalesced: outputs[i] has group size x the elements
//     of inputs[i], rank-major (as all_gather_into_tensor, per tensor);
//   - reduce_scatter_single_coalesced: inputs[i] has group size x the
//     elements of outputs[i]; rank r receives the r-th block of each;
//   - allgather_coalesced: output_lists[r][i] receives rank r's inputs[i].
// Tensors may differ in dtype: those of one dtype travel in one call, dtypes
// in order of first appearance, so every rank makes the same calls.
#include <c10/util/irange.h>

#include <algorithm>
#include <functional>
#include <mutex>

#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_types.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {
namespace {

// The tensors of one dtype, by index into the caller's list.
struct DtypeGroup {
  at::ScalarType dtype;
  std::vector<size_t> members;
};

std::vector<DtypeGroup> group_by_dtype(const std::vector<at::Tensor>& tensors) {
  std::vector<DtypeGroup> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const DtypeGroup& g) {
      return g.dtype == tensors[i].scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back({tensors[i].scalar_type(), {}});
      it = groups.end() - 1;
    }
    it->members.push_back(i);
  }
  return groups;
}

// What every rank must agree on: the call, the op, and each tensor's dtype
// and element count (a mismatch would make MPI read or write out of bounds).
int64_t fingerprint(const std::vector<at::Tensor>& tensors, int64_t op_id) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over 64-bit words
  auto mix = [&h](int64_t v) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ULL;
  };
  mix(op_id);
  for (const auto& t : tensors) {
    mix(static_cast<int64_t>(t.scalar_type()));
    mix(t.numel());
  }
  return static_cast<int64_t>(h >> 1);
}

void check_inputs(const std::vector<at::Tensor>& inputs, const char* arg) {
  TORCH_CHECK(!inputs.empty(), "ddpx_mpi: ", arg, " must hold at least one tensor");
  for (const auto i : c10::irange(inputs.size())) {
    check_dense(inputs[i], arg);
    TORCH_CHECK(inputs[i].device() == inputs[0].device(), "ddpx_mpi: ", arg, "[", i, "] is on ",
                inputs[i].device(), " but ", arg, "[0] is on ", inputs[0].device());
  }
}

// Large tensors go one nonblocking call each, straight between the caller's
// tensors (their rank-major layout is MPI's): packing them first cost a copy
// of every byte into a fresh buffer and one back, and a 64 MB reduce-scatter
// in 4 parts took 2.2x Gloo's time that way. Small ones are packed, one call
// per dtype, as latency dominates them. Decided on what the ranks agreed on
// (dtypes and sizes), never on layout, so every rank makes the same calls.
constexpr int64_t kDirectBytes = 64 << 10;  // average per tensor

bool go_direct(const std::vector<at::Tensor>& inputs) {
  int64_t bytes = 0;
  for (const auto& t : inputs) bytes += static_cast<int64_t>(t.nbytes());
  return bytes >= kDirectBytes * static_cast<int64_t>(inputs.size());
}

// One nonblocking collective per (output, input) pair, all in flight at once;
// `start` posts it between host views of the two. Non-contiguous or device
// tensors are staged by HostView; `after` (AVG's division) runs on each
// output before it is written back.
void direct_calls(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins,
                  const std::function<void(const HostView&, const HostView&, MPI_Request*)>& start,
                  const std::function<void(const at::Tensor&)>& after = {}) {
  std::vector<HostView> hin, hout;
  std::vector<MPI_Request> reqs(ins.size(), MPI_REQUEST_NULL);
  hin.reserve(ins.size());
  hout.reserve(ins.size());
  // Each call's memory is all of theirs: they are awaited, and abandoned,
  // together.
  std::vector<at::Tensor> memory;
  try {
    for (const auto i : c10::irange(ins.size())) {
      hin.emplace_back(ins[i], /*copy_in=*/true);
      hout.emplace_back(outs[i], /*copy_in=*/false);
      memory.push_back(hin[i].host());
      memory.push_back(hout[i].host());
      if (ins[i].numel() > 0) start(hin[i], hout[i], &reqs[i]);
    }
  } catch (...) {
    keep_until_complete(reqs, memory);  // the calls already posted
    throw;
  }
  await_requests(reqs, memory);
  for (const auto i : c10::irange(ins.size())) {
    if (after) after(hout[i].host());
    hout[i].write_back();
  }
}

// Gathers `inputs` from every rank (worker side). Returns, per input, a host
// tensor [group size, numel]: row r is rank r's tensor, flattened.
std::vector<at::Tensor> allgather_rows(MPI_Comm comm, int size,
                                       const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> rows(inputs.size());
  for (const auto& g : group_by_dtype(inputs)) {
    std::vector<at::Tensor> parts;
    for (size_t i : g.members) parts.push_back(inputs[i].reshape(-1).cpu());
    at::Tensor send = at::cat(parts);
    const int64_t total = send.numel();
    at::Tensor recv = at::empty({size, total}, send.options());
    if (total > 0) {
      MPI_Datatype dt = mpi_datatype(g.dtype);
      const int count = to_count(total, "the coalesced tensors of one dtype");
      MPI_Request req = MPI_REQUEST_NULL;
      DDPX_MPI_CHECK(
          MPI_Iallgather(send.data_ptr(), count, dt, recv.data_ptr(), count, dt, comm, &req));
      await_request(req, {send, recv});
    }
    int64_t offset = 0;
    for (size_t i : g.members) {
      const int64_t n = inputs[i].numel();
      rows[i] = recv.narrow(1, offset, n);
      offset += n;
    }
  }
  return rows;
}

// The (output, input) pairs of a coalesced single-tensor call: as many of
// each, alike in dtype, the larger side of each pair holding group size x the
// smaller's elements (all-gather: the outputs; reduce-scatter: the inputs).
void check_pairs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                 bool outputs_larger, int size, const char* op) {
  TORCH_CHECK(outputs.size() == inputs.size(), "ddpx_mpi: ", op,
              " needs the same number of outputs and inputs, got ", outputs.size(), " and ",
              inputs.size());
  const char* big = outputs_larger ? "outputs" : "inputs";
  const char* small = outputs_larger ? "inputs" : "outputs";
  for (const auto i : c10::irange(inputs.size())) {
    check_dense(outputs[i], "outputs[i]");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type(), "ddpx_mpi: outputs[", i,
                "] has dtype ", outputs[i].scalar_type(), " but inputs[", i, "] has ",
                inputs[i].scalar_type());
    const at::Tensor& b = outputs_larger ? outputs[i] : inputs[i];
    const at::Tensor& sm = outputs_larger ? inputs[i] : outputs[i];
    TORCH_CHECK(b.numel() == sm.numel() * size, "ddpx_mpi: ", big, "[", i,
                "] must have group size (", size, ") x ", small, "[", i,
                "] elements = ", sm.numel() * size, ", got ", b.numel());
    mpi_datatype(inputs[i].scalar_type(), "inputs[i]");
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> MpiBackend::DDPX_ALL_GATHER_SINGLE_COALESCED(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  check_inputs(inputs, "inputs");
  check_pairs(outputs, inputs, /*outputs_larger=*/true, size_, "all_gather_single_coalesced");
  const int64_t id = fingerprint(inputs, 21);
  const std::vector<at::Tensor> ins = inputs;
  const std::vector<at::Tensor> outs = outputs;
  return post(DDPX_OPTYPE_ALL_GATHER_SINGLE_COALESCED, outs, ins,
              [=, this](MpiWorker::Progress&) {
                check_agreement(comm_, {21, id}, "all_gather_single_coalesced",
                                std::to_string(ins.size()) + " tensors");
                if (go_direct(ins)) {
                  direct_calls(outs, ins, [this](const HostView& in, const HostView& out,
                                                 MPI_Request* req) {
                    MPI_Datatype dt = mpi_datatype(in.host().scalar_type());
                    DDPX_MPI_CHECK(MPI_Iallgather(in.ptr(), in.count(), dt, out.ptr(),
                                                  in.count(), dt, comm_, req));
                  });
                  return;
                }
                const auto rows = allgather_rows(comm_, size_, ins);
                for (const auto i : c10::irange(outs.size())) {
                  outs[i].copy_(rows[i].reshape(outs[i].sizes()));
                }
              });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_list,
    const c10d::AllgatherOptions&) {
  check_inputs(input_list, "input_list");
  TORCH_CHECK(static_cast<int>(output_lists.size()) == size_,
              "ddpx_mpi: allgather_coalesced: output_lists must hold one list per rank "
              "(group size ",
              size_, "), got ", output_lists.size());
  std::vector<at::Tensor> outs;
  for (const auto r : c10::irange(output_lists.size())) {
    TORCH_CHECK(output_lists[r].size() == input_list.size(), "ddpx_mpi: output_lists[", r, "] has ",
                output_lists[r].size(), " tensors but input_list has ", input_list.size());
    for (const auto i : c10::irange(input_list.size())) {
      const at::Tensor& o = output_lists[r][i];
      check_dense(o, "output_lists[r][i]");
      TORCH_CHECK(
          o.sizes() == input_list[i].sizes() && o.scalar_type() == input_list[i].scalar_type(),
          "ddpx_mpi: output_lists[", r, "][", i, "] is ", o.scalar_type(), o.sizes(),
          " but input_list[", i, "] is ", input_list[i].scalar_type(), input_list[i].sizes());
      outs.push_back(o);
    }
  }
  for (const auto& t : input_list) mpi_datatype(t.scalar_type(), "input_list[i]");
  const int64_t id = fingerprint(input_list, 22);
  const std::vector<at::Tensor> ins = input_list;
  const auto lists = output_lists;
  return post(c10d::OpType::ALLGATHER_COALESCED, outs, ins, [=, this](MpiWorker::Progress&) {
    check_agreement(comm_, {22, id}, "allgather_coalesced",
                    std::to_string(ins.size()) + " tensors");
    const auto rows = allgather_rows(comm_, size_, ins);
    for (const auto r : c10::irange(lists.size())) {
      for (const auto i : c10::irange(ins.size())) {
        lists[r][i].copy_(rows[i][static_cast<int64_t>(r)].view(lists[r][i].sizes()));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::DDPX_REDUCE_SCATTER_SINGLE_COALESCED(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_inputs(inputs, "inputs");
  check_pairs(outputs, inputs, /*outputs_larger=*/false, size_, "reduce_scatter_single_coalesced");
  for (const auto& t : inputs) {
    mpi_op(opts.reduceOp, t.scalar_type());  // e.g. AVG on integers: an error here
  }
  const c10d::ReduceOp reduce_op = opts.reduceOp;
  const bool avg = is_avg(reduce_op);
  const int64_t op_id = static_cast<int64_t>(reduce_op.op_);
  const int64_t id = fingerprint(inputs, 23 + 100 * op_id);
  const std::vector<at::Tensor> ins = inputs;
  const std::vector<at::Tensor> outs = outputs;
  return post(
      DDPX_OPTYPE_REDUCE_SCATTER_SINGLE_COALESCED, outs, ins, [=, this](MpiWorker::Progress&) {
        check_agreement(comm_, {23, id}, "reduce_scatter_single_coalesced",
                        std::to_string(ins.size()) + " tensors");
        if (go_direct(ins)) {
          const int n = size_;
          direct_calls(
              outs, ins,
              [this, reduce_op](const HostView& in, const HostView& out, MPI_Request* req) {
                const auto dtype = in.host().scalar_type();
                DDPX_MPI_CHECK(MPI_Ireduce_scatter_block(in.ptr(), out.ptr(), out.count(),
                                                         mpi_datatype(dtype),
                                                         mpi_op(reduce_op, dtype), comm_, req));
              },
              [avg, n](const at::Tensor& out) {
                if (avg) out.div_(n);
              });
          return;
        }
        for (const auto& g : group_by_dtype(ins)) {
          // Row r of `send` is what rank r receives: block r of every input.
          std::vector<at::Tensor> blocks;
          int64_t total = 0;
          for (size_t i : g.members) {
            blocks.push_back(ins[i].reshape({size_, outs[i].numel()}).cpu());
            total += outs[i].numel();
          }
          if (total == 0) continue;
          at::Tensor send = at::cat(blocks, 1).contiguous();  // [size, total]
          at::Tensor recv = at::empty({total}, send.options());
          const int count = to_count(total, "the coalesced outputs of one dtype");
          MPI_Request req = MPI_REQUEST_NULL;
          DDPX_MPI_CHECK(MPI_Ireduce_scatter_block(send.data_ptr(), recv.data_ptr(), count,
                                                   mpi_datatype(g.dtype),
                                                   mpi_op(reduce_op, g.dtype), comm_, &req));
          await_request(req, {send, recv});
          if (avg) recv.div_(size_);
          int64_t offset = 0;
          for (size_t i : g.members) {
            const int64_t n = outs[i].numel();
            outs[i].copy_(recv.narrow(0, offset, n).view(outs[i].sizes()));
            offset += n;
          }
        }
      });
}

void MpiBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_,
              "ddpx_mpi: startCoalescing: already coalescing (endCoalescing was not called)");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> MpiBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "ddpx_mpi: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<MpiWork>> works = std::move(coalesced_);
  coalesced_.clear();
  std::vector<at::Tensor> outputs;
  for (const auto& w : works) {
    for (const auto& t : w->result()) outputs.push_back(t);
  }
  const uint64_t seq = seq_++;
  auto joined = c10::make_intrusive<MpiWork>(rank_, c10d::OpType::COALESCED,
                                             what(c10d::OpType::COALESCED, seq), outputs, timeout_,
                                             "ddpx_mpi:COALESCED", std::nullopt);
  joined->set_order(order_);  // its callbacks' collectives are ordered as any Work's
  if (!works.empty()) joined->set_stream(works.front()->stream());  // (its Future's events)
  if (works.empty()) {
    joined->complete(nullptr);
    return joined;
  }
  // Completes with the first error of its members once the last is done.
  struct Join {
    std::mutex mu;
    size_t left;
    std::exception_ptr error;
  };
  auto join = std::make_shared<Join>();
  join->left = works.size();
  for (const auto& w : works) {
    w->on_done([join, joined](std::exception_ptr e) {
      bool last = false;
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lock(join->mu);
        if (e && !join->error) join->error = e;
        last = --join->left == 0;
        error = join->error;
      }
      if (last) joined->complete(error);
    });
  }
  return joined;
}

}  // namespace ddpx::comm::detail
