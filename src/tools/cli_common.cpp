#include "tools/cli_common.hpp"

#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>

#include "comm/local_comm.hpp"
#include "comm/mpi_comm.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "io/atomic_file.hpp"

namespace laga::tools {

void ModelOptions::add_to(CLI::App& app) {
  std::string names;
  for (auto& n : MlaConfig::preset_names()) names += (names.empty() ? "" : ", ") + n;
  app.add_option("--preset", preset, "model dimensions preset: " + names)->capture_default_str();
  app.add_option("--config", config_path,
                 "JSON config: DeepSeek ModelArgs (dim, n_heads, ...) or Hugging Face config.json "
                 "(hidden_size, ...); overrides --preset");
}

MlaConfig ModelOptions::load() const {
  protect_input(config_path, "--config");
  return config_path.empty() ? MlaConfig::preset(preset) : MlaConfig::from_json_file(config_path);
}

std::string ModelOptions::source() const {
  return config_path.empty() ? "preset " + preset : "config " + config_path;
}

void CommOptions::add_to(CLI::App& app) {
  // Parsed into the enum here, so a bad value stops the command before it runs.
  app.add_option_function<std::string>(
         "--comm", [this](const std::string& s) { backend = parse_comm_backend(s); },
         "collective backend: local (ranks as threads of this process) or mpi (one rank "
         "per process, launched with mpirun -np P)")
      ->default_str(to_string(backend));
  app.add_option("--comm-timeout", timeout_ms,
                 "milliseconds a collective waits for its peers before every rank stops with an "
                 "error naming the missing ones")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag_callback(
      "--no-memory-check", [this] { memory_check = false; },
      "run even when the predicted peak exceeds the memory this process may use");
}

Backend parse_comm_backend(const std::string& s) {
  LAGA_CHECK(s == to_string(Backend::local) || s == to_string(Backend::mpi), "--comm: '", s,
             "' is not a backend; use local (ranks as threads of this process) or mpi (one rank "
             "per process, launched with mpirun -np P)");
  return parse_backend(s);
}

std::vector<int> parse_int_list(const std::string& s, const std::string& option) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    try {
      size_t used = 0;
      const int x = std::stoi(tok, &used);
      LAGA_CHECK(used == tok.size() && x >= 1, "");
      v.push_back(x);
    } catch (const std::exception&) {
      fail(option, ": '", tok,
           "' is not a positive integer; give a comma-separated list like 1,2,4");
    }
  }
  LAGA_CHECK(!v.empty(), option, ": empty list; give a comma-separated list like 1,2,4");
  return v;
}

std::vector<Form> parse_form_list(const std::string& s) {
  if (s == "all") return all_forms();  // every registered form (mla/form.cpp)
  std::vector<Form> v;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) v.push_back(parse_form(tok));
  LAGA_CHECK(!v.empty(), "--forms: empty list; give e.g. explicit,absorbed,laga");
  return v;
}

namespace {
MpiSession& mpi_session() {
  static MpiSession session;  // MPI_Init on first use, MPI_Finalize at exit
  return session;
}
}  // namespace

bool is_reporting_process(const CommOptions& comm) {
  return comm.backend != Backend::mpi || mpi_session().world_rank() == 0;
}

void run_group(const CommOptions& comm, int P, const std::function<void(Communicator&)>& body) {
  const auto timeout = std::chrono::milliseconds(comm.timeout_ms);
  if (comm.backend == Backend::local) {
    LocalRunOptions opts;
    opts.timeout = timeout;
    run_local_ranks(P, body, opts);
    return;
  }
  MpiSession& s = mpi_session();
  LAGA_CHECK(s.world_size() == P, "--comm mpi: this job has ", s.world_size(),
             " MPI processes but --sp asks for ", P, "; launch with mpirun -np ", P,
             " (one rank per process), or use --comm local");
  set_rank_threads(threads_per_rank(P));
  auto c = make_mpi_communicator();
  c->set_timeout(timeout);
  body(*c);
}

void protect_input(const std::string& path, const std::string& option) {
  // One command per process: the guards live until exit.
  static std::vector<std::unique_ptr<ProtectedInputs>> guards;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  guards.push_back(std::make_unique<ProtectedInputs>(
      std::vector<std::pair<std::string, std::string>>{{path, option + " file"}}));
}

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text << std::flush;
    return;
  }
  write_file_atomic(path, text);
}

}  // namespace laga::tools
