// The subcommands of `laga`. Each cmd_*.cpp registers its own at static
// initialisation (LAGA_REGISTER_COMMAND), so adding a subcommand is adding a
// file. A registration function adds its CLI11 subcommand, options and
// callback (which runs during parse and may throw laga::Error).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

namespace laga::tools {

using CommandRegistration = std::function<void(CLI::App&)>;
std::vector<CommandRegistration>& command_registry();

// Readies the process for memory running out: glibc's unwinder link opened
// while there is memory, and under an address-space limit this process run
// again with OPENBLAS_NUM_THREADS=1 unless it has it (tools/blas_threads.cpp
// says why); returns only where it is not (no limit, already so, or exec
// failed).
void start_openblas_with_one_thread(char** argv);
bool register_command(CommandRegistration reg);

}  // namespace laga::tools

#define LAGA_REGISTER_COMMAND(fn) \
  static const bool laga_registered_##fn = ::laga::tools::register_command(fn)
