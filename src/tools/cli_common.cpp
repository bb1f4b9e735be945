#include "tools/cli_common.hpp"

#include <algorithm>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "comm/link_bounds.hpp"
#include "comm/local_comm.hpp"
#include "comm/mpi_comm.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "core/whole_number.hpp"
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
  MlaConfig cfg =
      config_path.empty() ? MlaConfig::preset(preset) : MlaConfig::from_json_file(config_path);
  // The resolved values: one path can hold different files on different nodes.
  note_run_identity("the model config (" + source() + ")", cfg.to_json().dump());
  return cfg;
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
      ->check(whole(1))
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
        const std::optional<std::int64_t> v = parse_whole_number(text);
        if (!v || *v < lo) return whole_number_refusal(text, lo);
        return "";
      },
      cat("INT >= ", lo));
}

CLI::Validator non_empty(const char* option, const char* fix) {
  return CLI::Validator(
      [option, fix](std::string& text) -> std::string {
        return text.empty() ? cat("an empty ", option, " means nothing; ", fix) : "";
      },
      "TEXT");
}

std::string whole_number_refusal(const std::string& text, std::int64_t lo) {
  return cat("'", text, "' is not a whole number >= ", lo,
             parse_whole_number(text) ? "" : " (decimal digits only, no leading zeros)");
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

LinkSpec parse_link(const std::string& text) {
  // The bounds are comm/link_bounds.hpp's, in GB/s: [1e-06, 1e+06].
  constexpr double kMinGbps = kLeastLinkBytesPerS / 1e9, kMaxGbps = kMostLinkBytesPerS / 1e9;
  constexpr double kMaxLatencyUs = kMostLinkLatencyUs;
  const std::string usage =
      "; give --link BW[,LAT]: BW in GB/s (10^9 bytes/s per direction) in [1e-06, 1e+06], LAT in "
      "microseconds in [0, 1e+07], e.g. --link 25,5";
  const size_t comma = text.find(',');
  const std::string bw = text.substr(0, comma);
  auto number = [&](const std::string& t, const char* what) {
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    LAGA_CHECK(!t.empty() && end == t.c_str() + t.size() && std::isfinite(v), "--link: ", what,
               " '", t, "' is not a finite number", usage);
    return v;
  };
  LinkSpec spec;
  const double gbps = number(bw, "bandwidth");
  LAGA_CHECK(gbps > 0, "--link: bandwidth ", bw, " GB/s is not positive", usage);
  LAGA_CHECK(gbps >= kMinGbps && gbps <= kMaxGbps, "--link: bandwidth ", bw,
             " GB/s is beyond what the link model holds a rank for", usage);
  spec.bytes_per_s = gbps * 1e9;
  if (comma != std::string::npos) {
    const std::string lat = text.substr(comma + 1);
    const double us = number(lat, "latency");
    LAGA_CHECK(us >= 0, "--link: latency ", lat, " us is negative", usage);
    LAGA_CHECK(us <= kMaxLatencyUs, "--link: latency ", lat,
               " us is beyond what the link model holds a rank for", usage);
    spec.latency_s = us * 1e-6;
  }
  return spec;
}

CLI::Validator link_spec() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          parse_link(text);
        } catch (const Error& e) {
          // CLI11 prefixes the option's name itself.
          const std::string m = e.what();
          return m.rfind("--link: ", 0) == 0 ? m.substr(8) : m;
        }
        return "";
      },
      "BW_GBPS[,LATENCY_US]");
}

std::vector<int> parse_int_list(const std::string& s, const std::string& option) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    const std::optional<std::int64_t> x = parse_whole_number(tok);
    LAGA_CHECK(x && *x >= 1 && *x <= std::numeric_limits<int>::max(), option, ": ",
               whole_number_refusal(tok, 1), "; give a comma-separated list like 1,2,4");
    v.push_back(static_cast<int>(*x));
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

std::string describe_variant(const FormVariant& v, const SpLayout& layout) {
  if (v.form != Form::laga2d) return to_string(v);
  return cat(to_string(v), " (", laga2d_grid(layout, v).describe(), ")");
}

OverlapRuns parse_overlap_runs(const std::string& s) {
  if (s == "off") return OverlapRuns::off;
  if (s == "on") return OverlapRuns::on;
  if (s == "both") return OverlapRuns::both;
  fail("--overlap: unknown value '", s, "'; choose off, on or both");
}

std::vector<FormVariant> form_variants(const std::vector<Form>& forms, bool q_latent,
                                       int head_groups, const MlaConfig& cfg, OverlapRuns overlap) {
  std::vector<FormVariant> v;
  for (Form f : forms) {
    const int groups = f == Form::laga2d ? head_groups : 0;
    v.push_back({f, QueryExchange::heads, groups});
    if (q_latent && (f == Form::laga || f == Form::laga2d))
      v.push_back({f, QueryExchange::latent, groups});
  }
  LAGA_CHECK(head_groups == 0 || std::find(forms.begin(), forms.end(), Form::laga2d) != forms.end(),
             "--head-groups applies to the laga2d form; --forms does not include it: add it "
             "(e.g. --forms laga,laga2d) or drop --head-groups");
  if (q_latent) {
    LAGA_CHECK(v.size() > forms.size(),
               "--q-latent applies to the laga and laga2d forms with q_lora_rank > 0; --forms "
               "includes neither: add one (e.g. --forms explicit,laga) or drop --q-latent");
    check_query_exchange(cfg, {Form::laga, QueryExchange::latent});
  }
  if (overlap == OverlapRuns::off) return v;
  std::vector<FormVariant> out;
  for (FormVariant f : v) {
    if (!form_overlaps(f.form)) {
      out.push_back(f);
      continue;
    }
    if (overlap == OverlapRuns::both) out.push_back(f);
    f.overlap = Overlap::on;
    out.push_back(f);
  }
  LAGA_CHECK(std::any_of(out.begin(), out.end(),
                         [](const FormVariant& f) { return f.overlap == Overlap::on; }),
             "--overlap applies to the laga and laga2d forms (they overlap the latent's "
             "collectives with compute); --forms includes neither: add one or drop --overlap");
  return out;
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

namespace {

std::mutex identity_mutex;
std::map<std::string, std::string>& run_identity() {
  static std::map<std::string, std::string> m;
  return m;
}

// FNV-1a: the same bytes give the same digest in every process.
std::uint64_t digest(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Every rank's (what, value) digests side by side; refuses naming the first
// entry whose value differs between ranks, or that some ranks lack.
void check_ranks_agree(Communicator& comm) {
  constexpr std::size_t kSlots = 128;  // (name, value) digest pairs per rank
  std::vector<std::pair<std::string, std::string>> mine;
  {
    std::lock_guard<std::mutex> lock(identity_mutex);
    mine.assign(run_identity().begin(), run_identity().end());
  }
  LAGA_CHECK(mine.size() <= kSlots, "internal: more than ", kSlots, " run options to compare");
  const int P = comm.size();
  const auto n = static_cast<std::int64_t>(2 * kSlots);
  std::vector<double> all(static_cast<std::size_t>(n * P), 0.0);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const std::uint64_t d[2] = {digest(mine[i].first), digest(mine[i].second)};
    std::memcpy(&all[static_cast<std::size_t>(n * comm.rank()) + 2 * i], d, sizeof d);
  }
  std::vector<std::int64_t> counts(static_cast<std::size_t>(P), n),
      displs(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) displs[static_cast<std::size_t>(r)] = r * n;
  const Ledger before = comm.ledger();
  comm.all_gather_v(all.data() + n * comm.rank(), n, all.data(), counts.data(), displs.data(),
                    "option_check");
  comm.ledger() = before;  // bookkeeping, not the job's traffic
  const auto slot = [&](int r, std::size_t i, int k) {
    std::uint64_t v;
    std::memcpy(&v, &all[static_cast<std::size_t>(n * r) + 2 * i + static_cast<std::size_t>(k)],
                sizeof v);
    return v;
  };
  for (std::size_t i = 0; i < mine.size(); ++i) {
    std::vector<int> differ, lack;
    for (int r = 0; r < P; ++r) {
      std::size_t j = 0;
      while (j < kSlots && slot(r, j, 0) != slot(comm.rank(), i, 0)) ++j;
      if (j == kSlots)
        lack.push_back(r);
      else if (slot(r, j, 1) != slot(comm.rank(), i, 1))
        differ.push_back(r);
    }
    const auto list = [](const std::vector<int>& v) {
      std::string s;
      for (int r : v) s += (s.empty() ? "" : ", ") + std::to_string(r);
      return s;
    };
    LAGA_CHECK(differ.empty() && lack.empty(), "the MPI ranks disagree on ", mine[i].first,
               ": rank ", comm.rank(), " has '", mine[i].second.substr(0, 200), "'",
               differ.empty() ? "" : ", rank(s) " + list(differ) + " have another value",
               lack.empty() ? "" : ", rank(s) " + list(lack) + " do not give it",
               "; launch every rank with the same options and files");
  }
}

}  // namespace

void note_command_line(int argc, char** argv) {
  // "--name value" and "--name=value" as options; a token after an option
  // that is not itself one is its value; the first token names the command.
  for (int i = 1; i < argc; ++i) {
    std::string tok = argv[i];
    if (tok.rfind("--", 0) != 0) {
      if (i == 1) note_run_identity("the subcommand", tok);
      continue;
    }
    std::string value;
    if (const auto eq = tok.find('='); eq != std::string::npos)
      value = tok.substr(eq + 1), tok = tok.substr(0, eq);
    else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0)
      value = argv[++i];
    note_run_identity("option " + tok, value);
  }
}

void note_run_identity(const std::string& what, const std::string& value) {
  std::lock_guard<std::mutex> lock(identity_mutex);
  run_identity()[what] = value;
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
  check_ranks_agree(*c);
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

void vet_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::string>> seen;  // option, resolved path or "-"
  for (const auto& [option, path] : outputs) {
    if (path.empty()) continue;
    std::string where = "-";
    if (path != "-") {
      const fs::path target = resolve_output_path(path, option);
      probe_writable_directory(target, option);
      std::error_code ec;
      where = fs::weakly_canonical(fs::absolute(target), ec).string();
      if (ec) where = fs::absolute(target).lexically_normal().string();
    }
    for (const auto& [other, other_where] : seen)
      LAGA_CHECK(other_where != where, option, " and ", other, " are one ",
                 where == "-" ? std::string("stream (stdout)") : cat("file ('", where, "')"),
                 ": the second write would replace the first; give each its own file");
    seen.emplace_back(option, where);
  }
}

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text << std::flush;
    return;
  }
  write_file_atomic(path, text);
}

void add_head_groups_option(CLI::App& app, int& head_groups) {
  app.add_option("--head-groups", head_groups,
                 "laga2d: Ph head groups x P/Ph context groups, Ph a divisor of --sp (default: "
                 "gcd(heads, --sp), the most groups that split the heads evenly)")
      ->check(CLI::PositiveNumber);
}

}  // namespace laga::tools
