#include "tools/cli_common.hpp"

#include <algorithm>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include <unistd.h>  // gethostname

#include <nlohmann/json.hpp>

#include "comm/local_comm.hpp"
#include "comm/mpi_comm.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors_set.hpp"
#include "mla/cuda_backend.hpp"
#include "model/checkpoint_manifest.hpp"

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
  // (The resolved values, not the file's name: --config's contents are
  // compared as an input file's, and a preset may equal a file.)
  note_run_identity("the model config", cfg.to_json().dump());
  if (const std::optional<DsaConfig> d = accepts_dsa ? std::nullopt : load_dsa(cfg))
    fail(source(), " sets DeepSeek Sparse Attention (index_topk ", d->index_topk,
         "): the lightning indexer and top-k attention, which this command does not run: it "
         "would attend every key, a different model. `laga plan` costs its DSA forms "
         "(docs/planning.md, \"DSA\"); for its dense MLA alone give a config without the "
         "index keys");
  return cfg;
}

std::optional<DsaConfig> ModelOptions::load_dsa(const MlaConfig& cfg) const {
  // A config's indexer is its MlaConfig's fields (read and validated with
  // it); a preset's MlaConfig is its dense MLA and DsaConfig::preset its
  // indexer.
  if (!config_path.empty()) return DsaConfig::of(cfg);
  const std::optional<DsaConfig> d = DsaConfig::preset(preset);
  if (d) d->validate(cfg);
  return d;
}

std::string ModelOptions::source() const {
  return config_path.empty() ? "preset " + preset : "config " + config_path;
}

void Fp8Options::add_to(CLI::App& app) {
  app.add_flag("--index-fp8", index_fp8,
               "DSA: the indexer scores as DeepSeek-V3.2's fp8 inference code does (Hadamard "
               "rotation, e4m3 act_quant, fp8_index): the config key index_fp8; needs "
               "index_head_dim 128 (docs/forms.md, \"The fp8 indexer\")");
  app.add_flag("--kv-fp8-round-trip", kv_fp8_round_trip,
               "DSA: DeepSeek's fp8 kv-cache simulation of the latent after kv_norm: the config "
               "key kv_fp8_round_trip; forward only, needs kv_lora_rank a multiple of 128");
}

void Fp8Options::apply(MlaConfig& cfg, const std::string& source,
                       const std::string& backward) const {
  for (auto [on, option] :
       {std::pair{index_fp8, "--index-fp8"}, std::pair{kv_fp8_round_trip, "--kv-fp8-round-trip"}})
    LAGA_CHECK(
        !on || cfg.dsa(), option, ": ", source,
        " is dense MLA (no index_n_heads, index_head_dim, index_topk), and the option is "
        "part of DeepSeek-V3.2's fp8 DSA path, which only a DSA block runs; drop ",
        option,
        " or give a DSA config (the index_n_heads, index_head_dim and index_topk keys or options)");
  // One key at a time, so that a refusal names the option that set it.
  for (auto [on, key, option] :
       {std::tuple{index_fp8, &MlaConfig::index_fp8, "--index-fp8"},
        std::tuple{kv_fp8_round_trip, &MlaConfig::kv_fp8_round_trip, "--kv-fp8-round-trip"}}) {
    if (!on) continue;
    cfg.*key = true;
    try {
      cfg.validate_dsa();
    } catch (const Error& e) {
      std::string why = e.what();  // "config: index_fp8 needs ...": the key's own rule
      if (why.rfind("config: ", 0) == 0) why.erase(0, 8);
      fail(option, " on ", source, ": ", why);
    }
  }
  // After the keys: the flag or the config's own key (which would otherwise
  // run to the first backward and be refused there, in mla/dsa_rows.cpp).
  const std::string named =
      kv_fp8_round_trip ? std::string("--kv-fp8-round-trip") : source + "'s key kv_fp8_round_trip";
  LAGA_CHECK(
      !cfg.kv_fp8_round_trip || backward.empty(), named, " simulates DeepSeek's ",
      "fp8 kv cache at inference and has no backward (the rounding's gradient is zero "
      "almost everywhere), and ",
      backward, " runs one; ",
      kv_fp8_round_trip ? "drop --kv-fp8-round-trip" : "set kv_fp8_round_trip false in the config",
      " (laga forward without --backward runs it)");
}

void CommOptions::add_to(CLI::App& app, bool takes_nccl) {
  // Parsed into the enum here, so a bad value stops the command before it runs.
  app.add_option_function<std::string>(
         "--comm",
         [this, takes_nccl](const std::string& s) { backend = parse_comm_backend(s, takes_nccl); },
         takes_nccl ? "collective backend: local (ranks as threads of this process; with "
                      "--device cuda they share the GPU), mpi (one rank per process, launched "
                      "with mpirun -np P), or nccl (with --device cuda: one rank per process and "
                      "GPU, launched with mpirun -np P)"
                    : "collective backend: local (ranks as threads of this process) or mpi (one "
                      "rank per process, launched with mpirun -np P)")
      ->default_str(to_string(backend));
  app.add_option("--comm-timeout", timeout_ms,
                 "milliseconds a collective waits for its peers before every rank stops with an "
                 "error naming the missing ones")
      ->check(whole_for(1, timeout_ms))
      ->capture_default_str();
  app.add_flag_callback(
      "--no-memory-check", [this] { memory_check = false; },
      "run even when the predicted peak exceeds the memory this process may use");
}

Backend parse_comm_backend(const std::string& s, bool takes_nccl) {
  if (s == to_string(Backend::nccl))
    LAGA_CHECK(takes_nccl,
               "--comm nccl: this command does not take NCCL (laga compare and forward do, "
               "with --device cuda); use local or mpi");
  LAGA_CHECK(s == to_string(Backend::local) || s == to_string(Backend::mpi) ||
                 s == to_string(Backend::nccl),
             "--comm: '", s,
             "' is not a backend; use local (ranks as threads of this process) or mpi (one rank "
             "per process, launched with mpirun -np P)",
             takes_nccl ? ", or nccl (with --device cuda, one process per GPU)" : "");
  return parse_backend(s);
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
  // Each listed form, and beside it what its traits admit of the options.
  bool any_groups = false;
  for (Form f : forms) {
    const FormTraits& t = form_spec(f).traits;
    const int groups = t.head_groups ? head_groups : 0;
    any_groups = any_groups || t.head_groups;
    v.push_back({f, QueryExchange::heads, groups});
    if (q_latent && t.query_latent) v.push_back({f, QueryExchange::latent, groups});
  }
  LAGA_CHECK(head_groups == 0 || any_groups, "--head-groups applies to the ",
             names_of_forms_with(&FormTraits::head_groups),
             forms_with(&FormTraits::head_groups).size() == 1 ? " form" : " forms",
             "; --forms includes none: add one (e.g. --forms laga,",
             to_string(forms_with(&FormTraits::head_groups).front()), ") or drop --head-groups");
  if (q_latent) {
    LAGA_CHECK(v.size() > forms.size(), "--q-latent applies to the ",
               names_of_forms_with(&FormTraits::query_latent),
               " forms with q_lora_rank > 0; --forms includes none of them: add one (e.g. --forms "
               "explicit,",
               to_string(forms_with(&FormTraits::query_latent).front()), ") or drop --q-latent");
    check_query_exchange(cfg,
                         {forms_with(&FormTraits::query_latent).front(), QueryExchange::latent});
  }
  if (overlap == OverlapRuns::off) return v;
  std::vector<FormVariant> out;
  for (FormVariant f : v) {
    if (!form_spec(f.form).traits.overlap) {
      out.push_back(f);
      continue;
    }
    if (overlap == OverlapRuns::both) out.push_back(f);
    f.overlap = Overlap::on;
    out.push_back(f);
  }
  LAGA_CHECK(std::any_of(out.begin(), out.end(),
                         [](const FormVariant& f) { return f.overlap == Overlap::on; }),
             "--overlap applies to the ", names_of_forms_with(&FormTraits::overlap),
             " forms (they overlap their collectives with compute); --forms includes none of "
             "them: add one or drop --overlap");
  return out;
}

namespace {
MpiSession& mpi_session() {
  static MpiSession session;  // MPI_Init on first use, MPI_Finalize at exit
  return session;
}
}  // namespace

bool is_reporting_process(const CommOptions& comm) {
  return !process_per_rank(comm.backend) || mpi_session().world_rank() == 0;
}

namespace {

std::mutex identity_mutex;
std::map<std::string, std::string>& run_identity() {
  static std::map<std::string, std::string> m;
  return m;
}
// How an entry is shown in a refusal where that differs from its value: an
// option left out is compared by its default's value but shown as
// "0 (its default; not given)".
std::map<std::string, std::string>& run_identity_shown() {
  static std::map<std::string, std::string> m;
  return m;
}

// The input files named by options (protect_input): option -> path. Under
// MPI their contents are compared across ranks, not their spellings: one path
// can hold different files on different nodes (-wdir, local disks), and
// `cfg/x.json` and `./cfg/x.json` are one file.
std::map<std::string, std::string>& input_files() {
  static std::map<std::string, std::string> m;
  return m;
}

// What a rank's input file is, as the ranks compare it: size and FNV-1a 64
// of the bytes. A directory (a sharded checkpoint) is its entries' names and
// sizes, with the bytes of its .json files (the index) and the headers of
// its .safetensors shards (names, dtypes, shapes, offsets): not the shards'
// data, which can be hundreds of GB.
std::string input_identity(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec))
    return cat(fs::file_size(path, ec), " bytes, FNV-1a 64 ", fnv1a64_hex(file_fnv1a64(path)));
  if (!fs::is_directory(path, ec)) return "(no such file)";
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file(ec)) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  std::string listing;
  for (const fs::path& e : entries) {
    listing += cat(e.filename().string(), " ", fs::file_size(e, ec));
    if (e.extension() == ".json") {
      listing += " " + fnv1a64_hex(file_fnv1a64(e.string()));
    } else if (e.extension() == ".safetensors") {
      std::ifstream in(e, std::ios::binary);
      std::uint64_t header = 0;
      in.read(reinterpret_cast<char*>(&header), sizeof header);
      std::string text(static_cast<size_t>(std::min<std::uint64_t>(header, 100u << 20)), '\0');
      in.read(text.data(), static_cast<std::streamsize>(text.size()));
      listing += " header " + fnv1a64_hex(fnv1a64(text));
    }
    listing += "\n";
  }
  return cat("directory of ", entries.size(), " files, FNV-1a 64 of its listing ",
             fnv1a64_hex(fnv1a64(listing)));
}

// Every rank's bytes, gathered to every rank (two all-gathers: the lengths,
// then the bytes packed eight to a double, which the collectives copy
// bit for bit).
std::vector<std::string> gather_texts(Communicator& comm, const std::string& mine) {
  const int P = comm.size();
  std::vector<double> lengths(static_cast<size_t>(P));
  std::vector<std::int64_t> ones(static_cast<size_t>(P), 1), at(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) at[size_t(r)] = r;
  const double my_length = static_cast<double>(mine.size());
  comm.all_gather_v(&my_length, 1, lengths.data(), ones.data(), at.data(), "option_check");
  std::vector<std::int64_t> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P));
  std::int64_t total = 0;
  for (int r = 0; r < P; ++r) {
    counts[size_t(r)] = (static_cast<std::int64_t>(lengths[size_t(r)]) + 7) / 8;
    displs[size_t(r)] = total;
    total += counts[size_t(r)];
  }
  std::vector<double> packed(static_cast<size_t>(counts[size_t(comm.rank())]), 0.0);
  std::memcpy(packed.data(), mine.data(), mine.size());
  std::vector<double> all(static_cast<size_t>(std::max<std::int64_t>(total, 1)));
  comm.all_gather_v(packed.data(), counts[size_t(comm.rank())], all.data(), counts.data(),
                    displs.data(), "option_check");
  std::vector<std::string> out;
  for (int r = 0; r < P; ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data() + displs[size_t(r)]),
                     static_cast<size_t>(lengths[size_t(r)]));
  return out;
}

// "0-3, 5, 7-8" for a sorted list of ranks.
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += (s.empty() ? "" : ", ") + std::to_string(ranks[i]) +
         (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return s;
}

constexpr const char* kFailure = "the failure of this rank";
const std::string kFileOf = "the file of option ";  // + "--weights": its contents

// Whether this process has taken part in check_ranks_agree (passed or not):
// its peers compare once, so a failure after it must not ask them again.
bool g_ranks_compared = false;

// Every rank's (what, value) entries side by side; every rank computes the
// same verdict from the same gathered bytes (FNV-1a: the same bytes give the
// same digest in every process), so all refuse at once with one message: the
// first entry (the command line first, a failure next, then the rest, each
// in name order) whose value differs between ranks or that some ranks lack,
// each value with its ranks.
void check_ranks_agree(Communicator& comm) {
  g_ranks_compared = true;
  std::map<std::string, std::string> mine, shown;
  {
    std::lock_guard<std::mutex> lock(identity_mutex);
    mine = run_identity();
    shown = run_identity_shown();
    for (const auto& [option, path] : input_files()) {
      // A value that names no file (a profile's name) is only its text.
      std::error_code ec;
      if (!std::filesystem::exists(path, ec)) continue;
      mine[option.rfind("--", 0) == 0 ? kFileOf + option : "the " + option + " file"] =
          "file of " + input_identity(path);
    }
  }
  // One line per entry: name \x1f digest \x1f the value's first 120 bytes
  // (a failure's whole message, up to 2000: every rank prints it, and its end
  // says what to do, e.g. the pid holding a checkpoint's lock).
  std::string text;
  for (const auto& [what, value] : mine) {
    const auto shown_as = shown.find(what);
    std::string preview = (shown_as == shown.end() ? value : shown_as->second)
                              .substr(0, what == kFailure ? 2000 : 120);
    for (char& ch : preview)
      if (ch == '\x1e' || ch == '\x1f' || ch == '\n') ch = ' ';
    text += what + "\x1f" + fnv1a64_hex(fnv1a64(value)) + "\x1f" + preview + "\x1e";
  }
  const Ledger before = comm.ledger();
  const std::vector<std::string> texts = gather_texts(comm, text);
  comm.ledger() = before;  // bookkeeping, not the job's traffic
  const int P = comm.size();
  // name -> rank -> (digest, preview)
  std::map<std::string, std::map<int, std::pair<std::string, std::string>>> table;
  for (int r = 0; r < P; ++r) {
    std::stringstream in(texts[size_t(r)]);
    std::string line;
    while (std::getline(in, line, '\x1e')) {
      const size_t a = line.find('\x1f'), b = line.find('\x1f', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      table[line.substr(0, a)][r] = {line.substr(a + 1, b - a - 1), line.substr(b + 1)};
    }
  }
  // The command line first (every rank noted all of it before parsing, so a
  // rank that failed early has it too), then a failure, then the rest.
  const auto from_command_line = [](const std::string& what) {
    return what == "the subcommand" || what.rfind("option ", 0) == 0;
  };
  std::vector<std::string> names;
  for (const auto& [what, by_rank] : table)
    if (from_command_line(what)) names.push_back(what);
  if (table.count(kFailure)) names.push_back(kFailure);
  for (const auto& [what, by_rank] : table)
    if (!from_command_line(what) && what != kFailure && what.rfind(kFileOf, 0) != 0)
      names.push_back(what);
  for (const std::string& what : names) {
    // An option naming an input file is compared by the file's contents
    // where every rank read it (`cfg/x.json` and `./cfg/x.json` are one
    // file; one path can be two files on two nodes), else by its text.
    const std::string file_row = kFileOf + what.substr(std::min(what.size(), size_t(7)));
    const bool by_contents = from_command_line(what) && table.count(file_row) &&
                             static_cast<int>(table[file_row].size()) == P;
    const auto& by_rank = table[by_contents ? file_row : what];
    std::map<std::string, std::vector<int>> holders;  // digest -> ranks
    std::vector<int> lack;
    for (int r = 0; r < P; ++r) {
      const auto it = by_rank.find(r);
      if (it == by_rank.end())
        lack.push_back(r);
      else
        holders[it->second.first].push_back(r);
    }
    if (holders.size() == 1 && lack.empty()) continue;
    // Values in the order of their lowest rank: rank 0's first.
    std::vector<std::vector<int>> groups;
    for (const auto& [d, ranks] : holders) groups.push_back(ranks);
    std::sort(groups.begin(), groups.end());
    std::string said;
    for (const std::vector<int>& ranks : groups)
      said +=
          cat(said.empty() ? "" : "; ", ranks.size() == 1 ? "rank " : "ranks ", rank_ranges(ranks),
              ranks.size() == 1 ? " has '" : " have '", by_rank.at(ranks.front()).second, "'");
    if (!lack.empty())
      said += cat(said.empty() ? "" : "; ", lack.size() == 1 ? "rank " : "ranks ",
                  rank_ranges(lack), lack.size() == 1 ? " does not give it" : " do not give it");
    if (what == kFailure)
      fail("an MPI rank stopped before the job began: ", said,
           "; every rank stops (fix that rank's input or environment and launch again)");
    fail("the MPI ranks disagree on ", what, ": ", said,
         "; launch every rank with the same options and files");
  }
}

}  // namespace

namespace {

// An option's value as the ranks compare it: what it means, not how it was
// spelt (issue 54, Q: `--lr 1e-3` on one rank and `--lr 0.001` on another,
// or `--lr 0.001` given on one and left at its default on another, were
// refused as a disagreement). Numbers in one spelling (a real as the
// shortest %g that reads back as it, -0 as 0; an integer in decimal), a
// flag as on/off, a dtype by its canonical name, --link's two reals each
// as a real; text as given. Text that
// does not parse is kept as it is: the option's own check refuses it.
// The shortest %g that reads back as x (0.0010000001, not
// 0.0010000001000000001); -0 as 0.
std::string shortest_real(double x) {
  x += 0.0;
  char buf[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

std::string canonical_value(const CLI::Option* opt, const std::string& value) {
  if (!opt) return value;
  if (opt->get_expected_max() == 0) {  // a flag: absent value or true/false
    std::string v = value;
    for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (v.empty() || v == "true" || v == "1" || v == "on" || v == "yes") return "on";
    if (v == "false" || v == "0" || v == "off" || v == "no") return "off";
    return value;
  }
  const std::string type = opt->get_type_name();
  if (type.rfind("FLOAT", 0) == 0) {
    if (const std::optional<double> v = parse_decimal_real(value)) return shortest_real(*v);
    return value;
  }
  if (opt->check_name("--link")) {  // BW[,LAT]: two reals
    const size_t comma = value.find(',');
    const std::optional<double> bw = parse_decimal_real(value.substr(0, comma));
    const std::optional<double> lat = comma == std::string::npos
                                          ? std::optional<double>()
                                          : parse_decimal_real(value.substr(comma + 1));
    if (bw && (comma == std::string::npos || lat))
      return shortest_real(*bw) + (lat ? "," + shortest_real(*lat) : std::string());
    return value;
  }
  // An integer has one spelling already: whole() refuses any other.
  if (opt->check_name("--dtype"))
    if (const std::optional<RunDtype> d = parse_run_dtype(value)) return to_string(*d);
  return value;
}

}  // namespace

void note_command_line(int argc, char** argv, const CLI::App& app) {
  // "--name value" and "--name=value" as options; a token after an option
  // that takes a value is its value; the first token names the command.
  // Each option is noted by its canonical value (canonical_value), and every
  // option of the command left out by its default where it has one, so that
  // an explicit default and an omitted option agree.
  const CLI::App* sub = nullptr;
  if (argc > 1) {
    for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
      if (s->check_name(argv[1])) sub = s;
  }
  const auto option = [&](const std::string& name) -> const CLI::Option* {
    return sub ? sub->get_option_no_throw(name) : nullptr;
  };
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    std::string tok = argv[i];
    if (tok.rfind("--", 0) != 0) {
      if (i == 1) note_run_identity("the subcommand", tok);
      continue;
    }
    std::string value;
    bool has_value = false;
    if (const auto eq = tok.find('='); eq != std::string::npos) {
      value = tok.substr(eq + 1), tok = tok.substr(0, eq), has_value = true;
    }
    const CLI::Option* opt = option(tok);
    const bool flag = opt && opt->get_expected_max() == 0;
    if (!has_value && !flag && i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0)
      value = argv[++i];
    given.insert(tok);
    note_run_identity("option " + tok, canonical_value(opt, value));
  }
  if (!sub) return;
  for (const CLI::Option* opt : sub->get_options()) {
    const std::vector<std::string>& names = opt->get_lnames();
    if (names.empty()) continue;
    const std::string name = "--" + names.front();
    // A flag left out is off; an option with no default (a size derived
    // from others) is not noted, and reads "does not give it".
    const bool flag = opt->get_expected_max() == 0;
    if (given.count(name) || (!flag && opt->get_default_str().empty())) continue;
    const std::string value = flag ? "off" : canonical_value(opt, opt->get_default_str());
    note_run_identity("option " + name, value);
    std::lock_guard<std::mutex> lock(identity_mutex);
    run_identity_shown()["option " + name] = value + " (its default; not given)";
  }
}

void note_run_identity(const std::string& what, const std::string& value) {
  std::lock_guard<std::mutex> lock(identity_mutex);
  run_identity()[what] = value;
}

void run_group(const CommOptions& comm, int P, const std::function<void(Communicator&)>& body) {
  const auto timeout = std::chrono::milliseconds(comm.timeout_ms);
  if (comm.backend == Backend::local) {
    // Forgetting --comm mpi under mpirun runs N copies of the job, each
    // alone, each writing the same outputs (issue 26): say so.
    static bool warned = false;  // once per command, which may run several groups
    if (const int n = mpi_launcher_world_size(); n > 1 && !std::exchange(warned, true))
      std::cerr << "laga: warning: an MPI launcher started " << n
                << " processes, but --comm local runs the whole job in each of them alone (" << n
                << " copies, not one job of " << n
                << " ranks); for one job across them pass --comm mpi\n";
    LocalRunOptions opts;
    opts.timeout = timeout;
    run_local_ranks(P, body, opts);
    return;
  }
  MpiSession& s = mpi_session();
  const bool nccl = comm.backend == Backend::nccl;
  LAGA_CHECK(s.world_size() == P, "--comm ", to_string(comm.backend), ": this job has ",
             s.world_size(), " MPI processes but --sp (laga train: --sp x --pp x --dp) asks for ",
             P, " ranks; launch with mpirun -np ", P,
             nccl ? " (one rank per process and GPU), or use --comm local (ranks as threads "
                    "sharing one GPU)"
                  : " (one rank per process), or use --comm local");
  set_rank_threads(threads_per_rank(P));
  auto c = make_mpi_communicator();
  c->set_timeout(timeout);
  check_ranks_agree(*c);
  if (!nccl) {
    body(*c);
    return;
  }
  // Rank 0's NCCL id to every rank, over MPI (its bytes as doubles, exact).
  const ops::CudaBackendApi& cuda = ops::load_cuda_backend();
  ops::NcclUniqueId id{};
  if (s.world_rank() == 0) id = cuda.make_nccl_id();
  const std::int64_t n = static_cast<std::int64_t>(id.size());
  std::vector<double> mine(id.size()), all(id.size() * static_cast<std::size_t>(P));
  for (std::size_t i = 0; i < id.size(); ++i) mine[i] = static_cast<unsigned char>(id[i]);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(P), n), displs;
  for (int r = 0; r < P; ++r) displs.push_back(r * n);
  c->all_gather_v(mine.data(), n, all.data(), counts.data(), displs.data(), "nccl_id");
  for (std::size_t i = 0; i < id.size(); ++i)
    id[i] = static_cast<char>(static_cast<unsigned char>(all[i]));
  std::unique_ptr<Communicator> group = cuda.make_nccl_communicator(id, s.world_rank(), P);
  group->set_timeout(timeout);
  body(*group);
}

void pick_nccl_device(const CommOptions& comm) {
  const ops::CudaBackendApi& cuda = ops::load_cuda_backend();
  MpiSession& s = mpi_session();
  // Every process's host name, gathered (as doubles, exact), to count the
  // job's processes on this host and this one's place among them.
  constexpr std::int64_t kName = 256;
  char name[kName] = {};
  gethostname(name, kName - 1);
  const int P = s.world_size();
  std::vector<double> mine(kName), all(static_cast<std::size_t>(kName * P));
  for (std::int64_t i = 0; i < kName; ++i)
    mine[static_cast<std::size_t>(i)] = static_cast<unsigned char>(name[i]);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(P), kName), displs;
  for (int r = 0; r < P; ++r) displs.push_back(r * kName);
  {
    auto c = make_mpi_communicator();
    c->set_timeout(std::chrono::milliseconds(comm.timeout_ms));
    c->all_gather_v(mine.data(), kName, all.data(), counts.data(), displs.data(), "host_names");
  }
  int here = 0, before = 0;
  for (int r = 0; r < P; ++r) {
    if (!std::equal(mine.begin(), mine.end(), all.begin() + r * kName)) continue;
    ++here;
    if (r < s.world_rank()) ++before;
  }
  const int gpus = cuda.device_count();
  LAGA_CHECK(here <= gpus, "--comm nccl: ", here, " ranks of this job run on host ", name,
             " but it has ", gpus,
             " GPU(s); NCCL puts each rank on its own GPU (it cannot hold two ranks of a group on "
             "one), so launch at most ",
             gpus,
             " processes per host, or run the ranks as threads sharing one GPU with --comm local "
             "(the device-local transport)");
  cuda.set_device(before);
}

void note_input_file(const std::string& option, const std::string& path) {
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(identity_mutex);
  input_files()[option] = path;
}

std::string agree_on_failure(const std::string& error, const std::vector<std::string>& args) {
  const auto mpi_asked = [&] {
    for (size_t i = 0; i < args.size(); ++i)
      for (Backend b : {Backend::mpi, Backend::nccl})
        if (args[i] == cat("--comm=", to_string(b)) ||
            (args[i] == "--comm" && i + 1 < args.size() && args[i + 1] == to_string(b)))
          return true;
    return false;
  };
  if (g_ranks_compared || !mpi_asked() || mpi_launcher_world_size() < 2) return error;
  try {
    note_run_identity(kFailure, error);
    MpiSession& s = mpi_session();
    if (s.world_size() < 2) return error;
    auto c = make_mpi_communicator();
    c->set_timeout(std::chrono::milliseconds(CommOptions{}.timeout_ms));
    check_ranks_agree(*c);
  } catch (const Error& verdict) {
    return verdict.what();
  }
  return error;  // every rank failed the same way: its own message says it
}

namespace {
void protect_until_exit(const std::vector<std::pair<std::string, std::string>>& files,
                        bool missing_too = false) {
  // One command per process: the guards live until exit.
  static std::vector<std::unique_ptr<ProtectedInputs>> guards;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  guards.push_back(std::make_unique<ProtectedInputs>(files, missing_too));
}
}  // namespace

void protect_input(const std::string& path, const std::string& option) {
  protect_until_exit({{path, option + " file"}});
  note_input_file(option, path);
}

void protect_own_executable() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) protect_until_exit({{self.string(), "laga executable"}});
}

void protect_weights(const std::string& path, const std::string& option) {
  protect_input(path, option);
  if (path.empty()) return;
  // Every file of the set, not just the path given: a directory's or an
  // index's shards are what an output could overwrite (issue 54 A). Opening
  // the set parses the index (or one file's header) and reads no tensor.
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& [file, kind] : SafetensorsSet::open(path).files())
    files.emplace_back(file, cat(option, " ", kind));
  // A shard the index lists but that is missing (not downloaded) is
  // protected by name: an output there would pose as it.
  protect_until_exit(files, /*missing_too=*/true);
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

void add_seq_layout_option(CLI::App& app, std::string& seq_layout) {
  app.add_option("--seq-layout", seq_layout,
                 "how the sequence is sharded over the --sp ranks: contiguous (rank r one "
                 "range, in rank order) or zigzag (2P chunks, rank r holding chunks r and "
                 "2P-1-r: the load-balanced layout of TransformerEngine's and Megatron's "
                 "context parallelism, which evens the causal work of the sequence-parallel "
                 "forms; docs/forms.md, \"The zigzag layout\")")
      ->check(CLI::IsMember({"contiguous", "zigzag"}))
      ->capture_default_str();
}

void add_grad_reduce_option(CLI::App& app, GradReduce& grad_reduce) {
  app.add_option_function<std::string>(
         "--grad-reduce",
         [&grad_reduce](const std::string& s) { grad_reduce = parse_grad_reduce(s); },
         "with --dtype bf16: the gradients held and all-reduced in fp32 (the default, as "
         "Megatron and DeepSeek-V3 keep them) or bf16 (half their bytes: each rank's gradient "
         "rounded to bf16, their fp32 sum rounded once)")
      ->check(CLI::IsMember({to_string(GradReduce::fp32), to_string(GradReduce::bf16)}))
      ->default_str(to_string(grad_reduce));
}

namespace {

// Where a dtype runs, for the refusal of a command that does not run it.
const char* commands_running(RunDtype d) {
  return d == RunDtype::fp64 ? "laga verify and laga forward (the kernels in double)"
                             : "every command";
}

}  // namespace

CLI::Option* add_dtype_option(CLI::App& app, std::function<void(RunDtype)> set,
                              std::vector<RunDtype> runs, const std::string& help) {
  // "fp32 (float32), bf16" in the help's set; "fp32 (float32) or bf16" in
  // a refusal.
  std::string set_names, names;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const RunDtype d = runs[i];
    const std::string name = std::string(to_string(d)) + (d == RunDtype::fp32   ? " (float32)"
                                                          : d == RunDtype::fp64 ? " (float64)"
                                                                                : "");
    set_names += (i ? ", " : "") + name;
    names += (i == 0 ? "" : i + 1 == runs.size() ? " or " : ", ") + name;
  }
  const std::string command = app.get_name();
  CLI::Validator admitted(
      [runs, names, command](std::string& s) -> std::string {
        const std::optional<RunDtype> d = parse_run_dtype(s);
        if (!d) return cat("'", s, "' is not a dtype; laga ", command, " runs ", names);
        if (std::find(runs.begin(), runs.end(), *d) == runs.end())
          return cat("laga ", command, " runs ", names, ", not ", to_string(*d), ", which runs in ",
                     commands_running(*d));
        return "";
      },
      "{" + set_names + "}");
  return app
      .add_option_function<std::string>(
          "--dtype", [set = std::move(set)](const std::string& s) { set(*parse_run_dtype(s)); },
          help)
      ->check(admitted);
}

void add_head_groups_option(CLI::App& app, int& head_groups) {
  app.add_option("--head-groups", head_groups,
                 cat("the grid forms (", names_of_forms_with(&FormTraits::head_groups),
                     "): Ph head groups x P/Ph context groups, Ph a divisor of --sp. Default: "
                     "laga2d gcd(heads, --sp), the most groups that split the heads evenly; "
                     "a2a_p2p the largest divisor of --sp below it that divides the heads, so "
                     "that a ring of context groups remains"))
      ->check(whole_for(1, head_groups));
}

void add_overlap_option(CLI::App& app, std::string& overlap, FormsRun runs) {
  const std::string forms = names_of_forms_with(&FormTraits::overlap);
  if (runs == FormsRun::one) {
    app.add_option("--overlap", overlap,
                   cat(forms,
                       ": on overlaps the form's collectives with compute (the latent all-gather "
                       "and its reduce-scatter with the query path; a ring's shift with its "
                       "step's attention); the same bytes and results (docs/forms.md)"))
        ->check(CLI::IsMember({"off", "on"}))
        ->capture_default_str();
    return;
  }
  app.add_option("--overlap", overlap,
                 cat("the collectives of the forms with an overlapped path (", forms,
                     ") overlapped with compute: off, on (they run overlapped) or both "
                     "(FORM+overlap right after each FORM); the same bytes and results "
                     "(docs/forms.md)"))
      ->check(CLI::IsMember({"off", "on", "both"}))
      ->capture_default_str();
}

void add_q_latent_flag(CLI::App& app, bool& q_latent, FormsRun runs) {
  const std::string forms = names_of_forms_with(&FormTraits::query_latent);
  const char* what =
      "the normalised query latent (rq per token) moved instead of per-head Q (H*dqk), wq_b "
      "applied for the rank's own heads";
  app.add_flag("--q-latent", q_latent,
               runs == FormsRun::one
                   ? cat(forms, " with q_lora_rank > 0: ", what, " (docs/forms.md)")
                   : cat("also run each form that can move the query latent (", forms,
                         ") with it, as FORM+q-latent right after FORM: ", what,
                         "; needs one of them among --forms and q_lora_rank > 0 "
                         "(docs/forms.md)"));
}

void add_attention_option(CLI::App& app, std::string& attention) {
  app.add_option("--attention", attention,
                 "attention kernel: eager (saves the (B, H_r, S, S) probabilities) or flash "
                 "(saves the log-sum-exp, recomputes in backward)")
      ->check(CLI::IsMember({"eager", "flash"}))
      ->capture_default_str();
}

}  // namespace laga::tools
