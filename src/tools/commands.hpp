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
bool register_command(CommandRegistration reg);

}  // namespace laga::tools

#define LAGA_REGISTER_COMMAND(fn) \
  static const bool laga_registered_##fn = ::laga::tools::register_command(fn)
