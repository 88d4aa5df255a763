#pragma once
// Writing the flight recorder out (flight_triggers.cpp); the public half is
// ddpx::comm::dump_trace and dump_trace_on_signal (comm.h).
#include <string>

namespace ddpx::comm::detail {

// The launcher's world rank (mpirun's, else torchrun's RANK; 0 alone).
int fr_process_rank();
// This process's recorder, as a dump's bytes (flight_dump.h).
std::string fr_current_dump();
// A collective timed out or failed (or a GradSync step did): writes the dump
// to <TORCH_FR_DUMP_TEMP_FILE><rank> once per process, when the recorder is
// on and TORCH_FR_DUMP_ON_TIMEOUT allows, and says where on stderr.
void fr_dump_after_failure(const std::string& why);

}  // namespace ddpx::comm::detail
