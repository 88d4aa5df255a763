// hooks/shard_reduce.h. Over MPI and NCCL the reduction is a reduce per
// part (their reduce sends each part to its owner once). Over Gloo it is an
// all-to-all instead (reduce_by_alltoall):
// Gloo's reduce is a ring reduce-scatter of the whole part followed by a
// gather to its root, so the parts' reduces moved about twice a
// reduce-scatter's bytes, in lock-step segments (100 MB of float32 on the
// 1 Gbit/s link: 2.0 s at 2 ranks, 2.8 s at 3, against 0.87 s and 1.5 s for
// the all-to-all and its sum; an all-reduce took 1.6 s and 3.2 s).
#include "hooks/shard_reduce.h"

#include <algorithm>
#include <array>
#include <optional>

#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::hooks {

namespace {

// Each part's collective (`issue(tensor, owner)`) on its slice of `flat`,
// all issued before any is awaited.
template <class Issue>
void per_part(const at::Tensor& flat, const std::vector<ShardPart>& parts, Issue issue) {
  std::vector<std::vector<at::Tensor>> ts;
  ts.reserve(parts.size());  // (the collectives take the vectors by reference)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  comm::detail::WireScope wire;
  for (const auto& part : parts) {
    ts.push_back({flat.narrow(0, part.offset, part.numel)});
    works.push_back(issue(ts.back(), part.rank));
  }
  for (auto& w : works) comm::detail::wait_named(w);
}

// The parts' sums, each into its owner's slice of `flat` (the others' slices
// are left as they were): an all-to-all per piece of kPieceBytes of
// each part (every rank sends each owner its piece, pieces in flight while
// the previous one is added), the owner adding the world's rows in rank order.
// Two ranks: the bits of any all-reduce of flat (x0 + x1 == x1 + x0).
void reduce_by_alltoall(const at::Tensor& flat, const std::vector<ShardPart>& parts,
                        c10d::ProcessGroup& pg) {
  const int world = pg.getSize(), rank = pg.getRank();
  std::vector<int64_t> offset(world, 0), numel(world, 0);
  for (const auto& part : parts) {
    offset[part.rank] = part.offset;
    numel[part.rank] = part.numel;
  }
  const int64_t piece = std::max<int64_t>(1, kPieceBytes / flat.element_size());
  const int64_t longest = *std::max_element(numel.begin(), numel.end());
  struct InFlight {
    at::Tensor send, recv;
    int64_t begin = 0, len = 0;  // this rank's slice of the piece
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::optional<InFlight> prev;
  auto add_rows = [&](InFlight& f) {
    comm::detail::wait_named(f.work);
    if (f.len == 0) return;
    at::Tensor rows = f.recv.view({world, f.len});
    at::Tensor dst = flat.narrow(0, offset[rank] + f.begin, f.len);
    dst.copy_(rows[0]);
    for (int r = 1; r < world; ++r) dst.add_(rows[r]);
  };
  comm::detail::WireScope wire;
  for (int64_t k = 0; k < longest; k += piece) {
    InFlight cur;
    std::vector<int64_t> send_splits(world), recv_splits(world);
    std::vector<at::Tensor> slices;
    for (int r = 0; r < world; ++r) {
      send_splits[r] = std::clamp<int64_t>(numel[r] - k, 0, piece);
      if (send_splits[r] > 0) slices.push_back(flat.narrow(0, offset[r] + k, send_splits[r]));
    }
    cur.begin = k;
    cur.len = std::clamp<int64_t>(numel[rank] - k, 0, piece);
    std::fill(recv_splits.begin(), recv_splits.end(), cur.len);
    cur.send = at::cat(slices);  // (k < longest: some part still has elements)
    // (One element more: an empty receive still gets a buffer to point at.)
    cur.recv = flat.new_empty({world * cur.len + 1}).narrow(0, 0, world * cur.len);
    cur.work =
        pg.alltoall_base(cur.recv, cur.send, recv_splits, send_splits, c10d::AllToAllOptions{});
    if (prev) add_rows(*prev);
    prev.emplace(std::move(cur));
  }
  if (prev) add_rows(*prev);
}

// Whether `flat`'s reduction to the owners goes through reduce_by_alltoall
// (Gloo) rather than a reduce per part (MPI's and NCCL's reduce send each
// part to its owner once).
bool reduces_by_alltoall(const at::Tensor& flat, c10d::ProcessGroup& pg) {
  return pg.getBackend(flat.device().type())->getBackendName() == "gloo";
}

}  // namespace

void reduce_to_owners(const at::Tensor& flat, const std::vector<ShardPart>& parts,
                      c10d::ProcessGroup& pg) {
  if (reduces_by_alltoall(flat, pg)) {
    reduce_by_alltoall(flat, parts, pg);
    return;
  }
  per_part(flat, parts, [&pg](std::vector<at::Tensor>& t, int owner) {
    c10d::ReduceOptions o;
    o.rootRank = owner;
    o.reduceOp = c10d::ReduceOp::SUM;
    return pg.reduce(t, o);
  });
}

void gather_from_owners(const at::Tensor& flat, const std::vector<ShardPart>& parts,
                        c10d::ProcessGroup& pg) {
  per_part(flat, parts, [&pg](std::vector<at::Tensor>& t, int owner) {
    c10d::BroadcastOptions o;
    o.rootRank = owner;
    return pg.broadcast(t, o);
  });
}

void gather_from_owners_in_pieces(const std::vector<ShardPart>& parts,
                                  const at::TensorOptions& options, c10d::ProcessGroup& pg,
                                  const PieceFn& fill, const PieceFn& take,
                                  const std::function<void(int64_t bytes)>& held) {
  const int rank = pg.getRank();
  const int64_t piece = std::max<int64_t>(
      1, kPieceBytes / static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType())));
  int64_t longest = 0;
  for (const auto& part : parts) longest = std::max(longest, part.numel);
  const int64_t len = std::min(piece, longest);
  if (len == 0) return;
  // Two slots, used in turn and never moved: a backend may hold on to the
  // tensor vector it was given until the broadcast completes.
  struct Slot {
    at::Tensor buffer;
    std::vector<at::Tensor> tensors;
    int64_t offset = 0;
    bool mine = false;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::array<Slot, 2> slots;
  for (auto& s : slots) s.buffer = at::empty({len}, options);
  const int64_t bytes = 2 * len * static_cast<int64_t>(slots[0].buffer.element_size());
  held(bytes);
  struct Release {  // (also when a broadcast fails)
    const std::function<void(int64_t)>& held;
    int64_t bytes;
    ~Release() { held(-bytes); }
  } release{held, bytes};
  auto land = [&](Slot& s) {
    if (!s.work) return;
    comm::detail::wait_named(s.work);
    s.work.reset();
    if (!s.mine) take(s.offset, s.tensors[0]);
  };
  comm::detail::WireScope wire;
  int next = 0;
  for (const auto& part : parts) {
    for (int64_t k = 0; k < part.numel; k += piece) {
      Slot& s = slots[next];
      next ^= 1;
      land(s);  // (the piece before last: its buffer is this one's)
      s.offset = part.offset + k;
      s.mine = part.rank == rank;
      s.tensors = {s.buffer.narrow(0, 0, std::min(piece, part.numel - k))};
      if (s.mine) fill(s.offset, s.tensors[0]);
      c10d::BroadcastOptions o;
      o.rootRank = part.rank;
      s.work = pg.broadcast(s.tensors, o);
    }
  }
  land(slots[next]);  // (the older of the two in flight first)
  land(slots[next ^ 1]);
}

}  // namespace ddpx::hooks
