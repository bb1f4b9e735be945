#include "tools/cli_common.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
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
  return config_path.empty() ? MlaConfig::preset(preset) : MlaConfig::from_json_file(config_path);
}

std::string ModelOptions::source() const {
  return config_path.empty() ? "preset " + preset : "config " + config_path;
}

void CommOptions::add_to(CLI::App& app) {
  app.add_option("--comm", backend,
                 "collective backend: local (ranks as threads of this process) or mpi (one rank "
                 "per process, launched with mpirun -np P)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  app.add_option("--comm-timeout", timeout_ms,
                 "milliseconds a collective waits for its peers before every rank stops with an "
                 "error naming the missing ones")
      ->check(whole(1))
      ->capture_default_str();
}

namespace {
std::string number_text(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}
}  // namespace

CLI::Validator whole(std::int64_t lo) {
  return CLI::Validator(
      [lo](std::string& text) -> std::string {
        const bool digits =
            !text.empty() &&
            text.find_first_not_of("0123456789", text[0] == '-' ? 1 : 0) == std::string::npos &&
            text != "-";
        std::int64_t v = 0;
        bool fits = digits;
        if (digits) {
          errno = 0;
          v = std::strtoll(text.c_str(), nullptr, 10);
          fits = errno != ERANGE;
        }
        if (!fits || v < lo)
          return cat("'", text, "' is not a whole number >= ", lo,
                     digits && fits ? "" : " (decimal digits only)");
        // Leading zeros would otherwise read as octal in CLI11 (010 -> 8).
        text = std::to_string(v);
        return "";
      },
      cat("INT >= ", lo));
}

CLI::Validator real(double lo, double hi, const char* bounds) {
  const bool lo_in = bounds[0] == '[', hi_in = bounds[1] == ']';
  const std::string interval =
      cat(lo_in ? "[" : "(", number_text(lo), ", ", number_text(hi), hi_in ? "]" : ")");
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool number = !text.empty() && end == text.c_str() + text.size();
        if (!number || !std::isfinite(v))
          return cat("'", text, "' is not a finite number in ", interval);
        if (v < lo || (v == lo && !lo_in) || v > hi || (v == hi && !hi_in))
          return cat(text, " is outside ", interval);
        return "";
      },
      "REAL in " + interval);
}

CLI::Validator real_at_least(double lo) {
  return real(lo, std::numeric_limits<double>::infinity(), "[)");
}

CLI::Validator real_above(double lo) {
  return real(lo, std::numeric_limits<double>::infinity(), "()");
}

template <class T>
NonFinite count_nonfinite(const T* x, std::int64_t n) {
  NonFinite r;
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) {
      if (r.count++ == 0) r.first = i;
    }
  return r;
}
template NonFinite count_nonfinite<float>(const float*, std::int64_t);
template NonFinite count_nonfinite<double>(const double*, std::int64_t);

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
  return comm.backend != "mpi" || mpi_session().world_rank() == 0;
}

void run_group(const CommOptions& comm, int P, const std::function<void(Communicator&)>& body) {
  const auto timeout = std::chrono::milliseconds(comm.timeout_ms);
  if (comm.backend == "local") {
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

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text << std::flush;
    return;
  }
  write_file_atomic(path, text);
}

}  // namespace laga::tools
