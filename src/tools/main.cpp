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

// CLI11's own words for a malformed command line ("Could not convert: --x =
// v", "--x: 1 required INT missing", "At Most 1 required but received 2",
// "The following argument was not expected: y") name neither what was
// wrong nor what to do; each is said again in laga's words (issue 54, T).
// The values' own checks (whole, real, ...) already speak laga's.
std::string explain_parse_error(const CLI::ParseError& e, const CLI::App* sub,
                                const std::string& cmd) {
  const std::string what = e.what();
  const auto option_named = [&](const std::string& name) -> const CLI::Option* {
    return sub ? sub->get_option_no_throw(name) : nullptr;
  };
  const std::string help = laga::cat("; see '", cmd, " --help'");
  if (dynamic_cast<const CLI::ConversionError*>(&e)) {
    // "Could not convert: NAME = VALUE", "NAME: too many inputs for a flag",
    // "NAME: Should be true/false or a number".
    std::string name = what, value;
    if (const auto p = what.find("Could not convert: "); p == 0) {
      const std::string rest = what.substr(19);
      const auto eq = rest.find(" = ");
      name = rest.substr(0, eq);
      value = eq == std::string::npos ? "" : rest.substr(eq + 3);
    } else if (const auto colon = what.find(':'); colon != std::string::npos) {
      name = what.substr(0, colon);
    }
    const CLI::Option* opt = option_named(name);
    if (opt && opt->get_expected_max() == 0)
      return laga::cat(name, " is a flag and takes no value",
                       value.empty() ? std::string() : laga::cat(" ('", value, "' given)"),
                       ": give ", name, " alone, or leave it out", help);
    return laga::cat(name, ": '", value, "' is not a value it takes",
                     opt ? laga::cat(" (", opt->get_type_name(), ")") : std::string(), help);
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e)) {
    const auto colon = what.find(": ");
    const std::string name = colon == std::string::npos ? std::string() : what.substr(0, colon);
    if (what.find(" required but received ") != std::string::npos &&
        what.find("At Most") != std::string::npos)
      return laga::cat(name, " is given ", what.substr(what.rfind(' ') + 1), " times; give it once",
                       help);
    if (what.find(" missing") != std::string::npos) {
      const CLI::Option* opt = option_named(name);
      return laga::cat(name, " needs a value after it",
                       opt ? laga::cat(" (", opt->get_type_name(), ")") : std::string(), help);
    }
    return laga::cat(what, help);
  }
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    const auto colon = what.find(": ");
    const std::string extras = colon == std::string::npos ? what : what.substr(colon + 2);
    // CLI11 lists the extras last first: the first one given is the last.
    const std::string first = extras.substr(extras.rfind(' ') + 1);
    if (first.rfind("-", 0) == 0)
      return laga::cat("'", first, "' is not an option of ", cmd,
                       " (options are spelt --name; a value that starts with '-' is given as "
                       "--name=VALUE)",
                       help);
    return laga::cat("unexpected argument '", first, "': ", cmd,
                     " takes options only (--name VALUE); a value belongs after its option", help);
  }
  if (dynamic_cast<const CLI::ValidationError*>(&e)) {
    // CLI::IsMember's "--schedule: linear not in {constant,cosine}"; laga's
    // own checks already speak laga's words.
    const auto colon = what.find(": "), in = what.rfind(" not in {");
    if (colon != std::string::npos && in != std::string::npos && in > colon && what.back() == '}') {
      std::string choices = what.substr(in + 9, what.size() - in - 10);
      for (size_t i = 0; (i = choices.find(',', i)) != std::string::npos; i += 2)
        choices.replace(i, 1, ", ");
      return laga::cat(what.substr(0, colon), ": '", what.substr(colon + 2, in - colon - 2),
                       "' is not one of ", choices, help);
    }
  }
  return laga::cat(what, help);
}

}  // namespace

int main(int argc, char** argv) {
  // The form registry is checked when first read (check_form_rows,
  // mla/form_registry.hpp: one reference row, distinct names); a build
  // whose rows break a rule stops here, before the help texts read them.
  try {
    laga::all_forms();
  } catch (const laga::Error& e) {
    std::cerr << "laga: " << e.what() << "\n";
    return 3;
  }
  CLI::App app{laga::cat("laga: the forms of sequence-parallel MLA (", laga::form_names(", "),
                         "), forward and backward, with exact wire bytes and activation memory")};
  app.require_subcommand(1);
  app.set_version_flag("--version", "laga 0.1.0");
  for (const auto& reg : laga::tools::command_registry()) reg(app);
  laga::tools::note_command_line(argc, argv, app);  // what MPI ranks must agree on
  laga::tools::protect_own_executable();
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
    const CLI::App* parsed = nullptr;
    for (const CLI::App* sub : app.get_subcommands()) cmd += " " + sub->get_name(), parsed = sub;
    return fail_exit(explain_parse_error(e, parsed, cmd));
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
