// laga — training-time sequence parallelism for Multi-head Latent Attention.
// One executable, one subcommand per job; each lives in its own cmd_*.cpp.
#include <CLI/CLI.hpp>

#include <iostream>

#include "core/blas_runtime.hpp"
#include "core/error.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"

namespace laga::tools {
std::vector<CommandRegistration>& command_registry() {
  static std::vector<CommandRegistration> registry;
  return registry;
}
bool register_command(CommandRegistration reg) {
  command_registry().push_back(std::move(reg));
  return true;
}
}  // namespace laga::tools

int main(int argc, char** argv) {
  laga::ensure_fast_blas_kernels(argv);
  CLI::App app{
      "laga: the explicit, absorbed and LAGA forms of sequence-parallel MLA, forward and "
      "backward, with exact wire bytes and activation memory"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "laga 0.1.0");
  for (const auto& reg : laga::tools::command_registry()) reg(app);
  laga::tools::note_command_line(argc, argv);  // what MPI ranks must agree on
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const laga::Error& e) {
    std::cerr << "laga: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "laga: internal error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
