// ddpx_mpi: point-to-point. Sends and receives are posted non-blocking and
// completed by the worker's polling (mpi_work.h step 3).
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <memory>
#include <optional>

#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_types.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {

void MpiBackend::check_tag(int tag) const {
  TORCH_CHECK(tag >= 0 && tag <= tag_ub_, "ddpx_mpi: tag must be in [0, ", tag_ub_, "], got ",
              tag);
}

c10::intrusive_ptr<c10d::Work> MpiBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                int tag) {
  check_single(tensors, "tensors");
  check_rank(dst_rank, size_, "dstRank");
  check_tag(tag);
  const at::Tensor t = tensors[0];
  const int count = to_count(t.numel(), "tensors[0]");
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  return post(c10d::OpType::SEND, {}, tensors, [=, this](MpiWorker::Progress& p) {
    // The host copy must live until MPI is done with it: the completion owns it.
    auto h = std::make_shared<HostView>(t, /*copy_in=*/true, Transfer::kPointToPoint);
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Isend(h->ptr(), count, dt, dst_rank, tag, comm_, &req));
    p.defer(req, [h](const MPI_Status&) {});
  }, std::nullopt, dst_rank);
}

c10::intrusive_ptr<MpiWork> MpiBackend::post_recv(std::vector<at::Tensor>& tensors, int src,
                                                  int tag) {
  check_single(tensors, "tensors");
  check_tag(tag);
  const at::Tensor t = tensors[0];
  const int count = to_count(t.numel(), "tensors[0]");
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  const c10d::OpType type = src == MPI_ANY_SOURCE ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV;
  return post(type, tensors, {}, [=, this](MpiWorker::Progress& p) {
    auto h = std::make_shared<HostView>(t, /*copy_in=*/false, Transfer::kPointToPoint);
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Irecv(h->ptr(), count, dt, src, tag, comm_, &req));
    // The copy back runs when the message is in, from the worker's polling:
    // under the caller's stream (current here: post() set it), as every
    // device copy, so it lands after what the caller queued before the recv.
    std::optional<c10::Stream> stream;
    if (!t.is_cpu()) stream = c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
    p.defer(req, [h, count, dt, stream, work = p.work](const MPI_Status& status) {
      const c10::OptionalStreamGuard guard(stream);
      int received = 0;
      DDPX_MPI_CHECK(MPI_Get_count(&status, dt, &received));
      TORCH_CHECK(received == count, "ddpx_mpi: recv from rank ", status.MPI_SOURCE,
                  " got ", received, " elements but the tensor holds ", count,
                  ": sender and receiver tensors differ in size");
      h->write_back();
      work->set_source_rank(status.MPI_SOURCE);
    }, /*receive=*/true);
  }, std::nullopt, src == MPI_ANY_SOURCE ? -1 : src);
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                int tag) {
  check_rank(src_rank, size_, "srcRank");
  return post_recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                         int tag) {
  return post_recv(tensors, MPI_ANY_SOURCE, tag);
}

}  // namespace ddpx::comm::detail
