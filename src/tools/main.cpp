// laga — training-time sequence parallelism for Multi-head Latent Attention.
// One executable, one subcommand per job; each lives in its own cmd_*.cpp.
//
// Every failure the user can cause ends here in one format, "laga: error:
// <what was wrong and what to do>", with exit status 2 (docs/reliability.md,
// "Inputs and options"): laga::Error, CLI11's parse errors (unknown or
// malformed options, values a check refused) and memory exhaustion alike.
// --help and --version exit 0; `laga verify` exits 1 on a disagreement.
#include <CLI/CLI.hpp>

#include <iostream>
#include <new>
#include <string>
#include <vector>

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

namespace {

int error_exit(const std::string& what) {
  // A message that already carries the prefix (an error relayed from another
  // rank or process) is not prefixed twice.
  const std::string prefix = "laga: error: ";
  // One write: MPI ranks share a terminal, and pieces would interleave.
  std::cerr << (what.rfind(prefix, 0) == 0 ? "" : prefix) + what + "\n" << std::flush;
  return 2;
}

std::string command_names(const CLI::App& app) {
  std::string names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names += (names.empty() ? "" : ", ") + sub->get_name();
  return names;
}

bool is_command(const CLI::App& app, const std::string& name) {
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    if (sub->check_name(name)) return true;
  return false;
}

// CLI11's own positive-number check prints "Value 0 not in range 0.000000 to
// 1797...(300 digits)"; every laga option it guards is a whole number, so it
// is replaced by whole(1), whose message says what was given and what is
// allowed. (Subcommands not yet moved to whole(1) get it this way.)
// (CLI11 keeps "POSITIVE" as the check's description; its name is empty.)
void replace_positive_checks(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    for (CLI::Option* opt : sub->get_options()) {
      for (int i = 0;; ++i) {
        CLI::Validator* v = nullptr;
        try {
          v = opt->get_validator(i);
        } catch (const CLI::OptionNotFound&) {
          break;  // no more checks on this option
        }
        if (v->get_description() == "POSITIVE") *v = laga::tools::whole(1);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{laga::cat("laga: the forms of sequence-parallel MLA (", laga::form_names(", "),
                         "), forward and backward, with exact wire bytes and activation memory")};
  app.require_subcommand(1);
  app.set_version_flag("--version", "laga 0.1.0");
  for (const auto& reg : laga::tools::command_registry()) reg(app);
  laga::tools::note_command_line(argc, argv);  // what MPI ranks must agree on
  replace_positive_checks(app);

  // An unknown command would otherwise read "A subcommand is required".
  if (argc > 1 && argv[1][0] != '-' && !is_command(app, argv[1]))
    return error_exit(laga::cat("unknown command '", argv[1], "'; the commands are: ",
                                command_names(app), " (laga COMMAND --help for each)"));
  if (argc == 1)
    return error_exit(
        laga::cat("give a command: ", command_names(app), " (laga COMMAND --help for each)"));
  // Under MPI a rank that fails before its job begins joins the ranks'
  // comparison with its failure, so its peers stop with it (agree_on_failure).
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto fail_exit = [&](const std::string& what) {
    return error_exit(laga::tools::agree_on_failure(what, args));
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help, --version (exit 0) and verify's exit 1 keep CLI11's handling.
    if (e.get_exit_code() == 0 || dynamic_cast<const CLI::RuntimeError*>(&e) != nullptr)
      return app.exit(e);
    std::string cmd = "laga";
    for (const CLI::App* sub : app.get_subcommands()) cmd += " " + sub->get_name();
    return fail_exit(laga::cat(e.what(), "; see '", cmd, " --help'"));
  } catch (const laga::Error& e) {
    return fail_exit(e.what());
  } catch (const std::bad_alloc& e) {
    // Tensors name themselves when they cannot be allocated (laga::Error);
    // this is any other allocation: operator new (out_of_memory.cpp) says how
    // large it was, anything else gets the generic advice.
    const std::string what = e.what();
    return fail_exit(what.rfind("out of memory", 0) == 0
                         ? what
                         : "out of memory: an allocation found no memory; use a smaller --seq, "
                           "--batch or --vocab, or a larger --sp");
  } catch (const std::exception& e) {
    std::cerr << "laga: internal error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
