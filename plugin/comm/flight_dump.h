#pragma once
// The flight recorder's dumps (flight_recorder.h): PyTorch's flight-recorder
// dump format, the pickle its analyzer reads (python -m
// torch.distributed.flight_recorder.fr_trace DIR), version "2.10" as PyTorch
// 2.15 writes it, one file per rank at <prefix><rank>.
//
// The dict, as PyTorch's (FlightRecorderDetail.hpp): "version", "pg_config"
// {group name: {name, desc, ranks}}, "pg_status" {group index: last
// enqueued / started / completed collective}, "comm_lib_version", and
// "entries", oldest first, each with record_id, pg_id, process_group (name,
// desc), collective_seq_id, p2p_seq_id, op_id, profiling_name
// ("ddpx_mpi:all_reduce", "ddpx_mpi:send 0->1", "gradsync:all_reduce"),
// time_created_ns, duration_ms, input/output sizes and dtypes, state
// (scheduled / started / completed), time_discovered_started_ns and
// _completed_ns, retired, timeout_ms, is_p2p, thread_id, thread_name and
// frames (empty: no stacks are taken). ddpx adds keys PyTorch's analyzer
// ignores: "ddpx_rank" (top level), and per entry "ddpx_step",
// "ddpx_bucket", "ddpx_params" (GradSync's) and "ddpx_failed".
//
// PyTorch 2.15's analyzer reads these as they are (it warns once that it
// does not know the comm library "ddpx_mpi"); 2.11's refuses every comm
// library but nccl and xccl, Gloo's own dumps included.
#include <string>
#include <vector>

#include "plugin/comm/flight_recorder.h"

namespace ddpx::comm::detail {

constexpr const char* kFrVersion = "2.10";

// `snap` of rank `rank` as a dump's bytes; `comm_lib`: the comm library's
// name and version.
std::string fr_dump_bytes(const FrSnapshot& snap, int rank, const std::string& comm_lib);

// A dump read back: its rank (-1 if it does not say) and records. Throws a
// c10::Error naming `what` (e.g. the file) on what is not such a dump.
struct FrDump {
  int rank = -1;
  FrSnapshot snap;
};
FrDump fr_parse_dump(const std::string& bytes, const std::string& what);

// Writes `bytes` to `path` whole (a temporary file renamed into place, so a
// reader never sees half a dump). Throws a c10::Error naming the path.
void fr_write_file(const std::string& path, const std::string& bytes);
std::string fr_read_file(const std::string& path);

// The record's profiling name as the analyzer parses it: "<lib>:<op>", with
// "src->dst" / "dst<-src" (group ranks; "?" for any source) for a send or a
// receive. `self` is this rank's rank in the record's group.
std::string fr_profiling_name(const FrRecord& r, const std::string& lib, int self);

}  // namespace ddpx::comm::detail
