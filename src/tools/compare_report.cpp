// `laga compare` output: the human table, the JSON document and the CSV rows.
// Bytes are integers in JSON and CSV; the table shows them in MB (10^6
// bytes, as the paper's tables; kB or bytes for small runs) and says which in
// every header.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "mla/comm_model.hpp"
#include "mla/form_registry.hpp"
#include "tools/compare.hpp"

namespace laga::tools {

namespace {

using ojson = nlohmann::ordered_json;

// One decimal unit for every byte figure of a report, chosen so that the
// largest has a few digits before the point: MB for DeepSeek-V3 sizes, kB or
// B for tiny ones. The unit is named in every header.
struct ByteUnit {
  double scale = 1e6;
  const char* name = "MB = 10^6 bytes";
};
ByteUnit g_unit;  // set by compare_table for the report it is writing

ByteUnit unit_for(const CompareResult& r) {
  std::int64_t biggest = 0;
  for (const FormResult& f : r.results)
    biggest = std::max({biggest, f.sent_total, f.peak, f.peak_grad_sync, f.parameters});
  if (biggest >= 10'000'000) return {1e6, "MB = 10^6 bytes"};
  if (biggest >= 10'000) return {1e3, "kB = 10^3 bytes"};
  return {1, "bytes"};
}

std::string mb(std::int64_t bytes) {
  char b[32];
  if (g_unit.scale == 1)
    std::snprintf(b, sizeof b, "%lld", static_cast<long long>(bytes));
  else
    std::snprintf(b, sizeof b, "%.2f", double(bytes) / g_unit.scale);
  return b;
}
std::string fixed(double v, int digits) {
  char b[48];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}
std::string sci(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2e", v);
  return b;
}
std::string relative(double v, double ref) {  // "+0.41%" against a reference
  if (ref <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%+.2f%%", 100.0 * (v - ref) / ref);
  return b;
}

// Columns padded to their widest cell; the first left-aligned, the rest right.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string str() const {
    std::vector<size_t> w;
    for (const auto& r : rows_)
      for (size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    std::ostringstream s;
    for (size_t k = 0; k < rows_.size(); ++k) {
      const auto& r = rows_[k];
      s << "  ";
      for (size_t i = 0; i < r.size(); ++i) {
        const std::string pad(w[i] - r[i].size(), ' ');
        s << (i ? "  " : "")
          << (i == 0 || (i + 1 == r.size() && last_left_) ? r[i] + pad : pad + r[i]);
      }
      s << "\n";
      if (k == 0) {
        size_t total = 0;
        for (size_t i = 0; i < w.size(); ++i) total += w[i] + (i ? 2 : 0);
        s << "  " << std::string(total, '-') << "\n";
      }
    }
    return s.str();
  }
  Table& last_left() {
    last_left_ = true;
    return *this;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
  bool last_left_ = false;
};

const FormResult* find_reference(const CompareResult& r) {
  for (const FormResult& f : r.results)
    if (f.form.form == reference_form()) return &f;
  return nullptr;
}

std::string mode_line(const CompareResult& r) {
  const CompareOptions& o = r.options;
  std::string s;
  if (o.rank_only >= 0)
    s = cat("rank ", o.rank_only, " of ", o.sp, " alone (dry run)");
  else
    s = cat("every rank of ", o.sp, ", backend ", to_string(o.comm.backend),
            o.comm.backend == Backend::local
                ? cat(" (ranks as threads, ", r.threads_per_rank, " BLAS/OpenMP thread(s) each)")
                : std::string());
  s += o.count_only ? ", count-only (no storage, no kernels)" : "";
  return s;
}

std::string ranks_word(const CompareResult& r) {
  return r.measured_ranks.size() == 1 ? cat("rank ", r.measured_ranks[0], " only")
                                      : std::string("max over ranks");
}

}  // namespace

std::string compare_table(const CompareResult& r) {
  const CompareOptions& o = r.options;
  g_unit = unit_for(r);
  const std::string unit = g_unit.name;
  std::ostringstream s;
  s << "laga compare: " << o.model.source() << " (" << r.cfg.summary() << ")\n";
  s << "  B=" << r.layout.batch << " S=" << r.layout.seq << " P=" << r.layout.ranks << " ("
    << r.layout.describe() << "), " << to_string(r.attention) << " attention, "
    << (r.options.precision != Precision::bf16 ? "fp32"
        : r.options.grad_reduce == GradReduce::bf16
            ? "bf16 mixed precision (bf16 values in fp32 tensors; every collective moves bf16, "
              "the gradient all-reduce too)"
            : "bf16 mixed precision (bf16 values in fp32 tensors; activation collectives move "
              "bf16, the gradient all-reduce fp32)")
    << "\n";
  if (r.documents)
    s << "  packed: documents " << r.documents->describe() << " (attention within documents, "
      << "RoPE positions restart at each)\n";
  s << "  " << mode_line(r);
  if (!o.count_only)
    s << "; " << r.results.front().step_ms_all.size() << " measured step(s) after " << o.warmup
      << " warm-up";
  s << "\n";
  if (!r.values_meaningful)
    s << "  VALUES ARE NOT NUMERICALLY MEANINGFUL in this mode; bytes and memory are exact.\n";
  for (const std::string& n : r.notes) s << "  note: " << n << "\n";
  const std::string who = ranks_word(r);

  s << "\nBytes sent per rank [" << unit << "], " << who
    << ". measured: the communicator's ledger; model: closed form (mla/comm_model)\n";
  Table bytes({"form", "fwd", "model", "fwd+bwd", "model", "grad all-reduce", "model", "total",
               "model", "match"});
  for (const FormResult& f : r.results)
    bytes.add({to_string(f.form), mb(f.sent_forward), mb(f.predicted_forward),
               mb(f.sent_forward + f.sent_backward), mb(f.predicted_forward + f.predicted_backward),
               mb(f.sent_grad_sync), mb(f.predicted_grad_sync), mb(f.sent_total),
               mb(f.predicted_total), f.bytes_match ? "exact" : "NO"});
  s << bytes.str();
  if (const FormResult* ex = find_reference(r)) {
    for (const FormResult& f : r.results)
      if (f.form.form != reference_form() && f.sent_forward > 0)
        s << "  " << to_string(ex->form) << "/" << to_string(f.form)
          << " forward bytes: " << fixed(double(ex->sent_forward) / double(f.sent_forward), 3)
          << "x\n";
  }

  s << "\nBy collective (bytes per rank [" << unit << "], " << who << ")\n";
  Table lab({"form", "phase", "label", "calls", "sent", "model", "received", "model", "match"});
  for (const FormResult& f : r.results)
    for (const LabelRow& l : f.by_label)
      lab.add({to_string(f.form), to_string(l.phase), l.label, std::to_string(l.calls),
               mb(l.bytes_sent), mb(l.predicted_sent), mb(l.bytes_received),
               mb(l.predicted_received), l.match ? "exact" : "NO"});
  s << lab.str();

  s << "\nPeak activation memory per rank [" << unit << "], " << who
    << ": activations + collective staging during forward+backward, above the input shard.\n"
       "  measured: the memory pool; model: mla/memory_model (the allocation sequence replayed)\n";
  const FormResult* ex = find_reference(r);
  Table mem({"form", "peak", "model", "match", "vs explicit", "activations", "comm staging",
             "grad all-reduce", "params", "grads", "model: peak reached at"});
  for (const FormResult& f : r.results)
    mem.add({to_string(f.form), mb(f.peak), mb(f.predicted_peak),
             f.memory_match ? "exact" : "NO " + fixed(100 * f.memory_rel_error, 2) + "%",
             ex ? relative(double(f.peak), double(ex->peak)) : "-", mb(f.peak_activations),
             mb(f.peak_comm_buffers), mb(f.peak_grad_sync), mb(f.parameters), mb(f.gradients),
             f.model_peak.where});
  s << mem.last_left().str();
  s << "  (activations / comm staging: each category's own peak over the whole step; grad "
       "all-reduce: the peak while gradients are summed; params and grads are held apart)\n";
  if (r.options.precision == Precision::bf16)
    s << "  bf16: the columns include the op layer's bf16 operand copies and the bf16 flash "
         "kernels' ("
      << to_string(flash_bf16_isa())
      << ") workspace, pool tensors while their op runs (docs/accounting.md, \"bf16 operand "
         "copies and attention scratch\")\n";
  if (o.device != Device::cpu) {
    s << "  device peak per rank on " << to_string(o.device)
      << " (mla/device_peak_prediction.hpp): the pool's working peak (fwd+bwd or grad "
         "all-reduce) + what the backend keeps per rank thread in a size laga chooses"
      << (o.device == Device::cuda ? " (the cuBLASLt workspace; cuDNN's is measured only)" : "")
      << "\n";
    for (const FormResult& f : r.results)
      s << "    " << to_string(f.form) << ": " << mb(f.device_peak) << " (kept "
        << mb(f.device_kept_predicted) << "), model " << mb(f.predicted_device_peak) << "\n";
  }
  for (const FormResult& f : r.results) {
    s << "  " << to_string(f.form) << " at its peak (rank " << f.peak_rank << ", model):";
    int shown = 0;
    for (const MemoryTerm& t : f.model_peak.live) {
      if (shown++ == 4) break;
      s << (shown > 1 ? "," : "") << " " << t.name << " " << mb(t.bytes);
    }
    s << "\n";
  }

  s << "\nAttention work per rank, forward, computed (mla/work_model: the (query, key) pairs of "
       "the causal"
    << (r.documents ? ", document" : "") << " mask x the rank's heads x (d_qk + d_v) x 2)\n";
  Table work({"form", "max GFLOP", "min GFLOP", "max/min"});
  for (const FormResult& f : r.results)
    work.add({to_string(f.form), fixed(f.attention_flops_max / 1e9, 3),
              fixed(f.attention_flops_min / 1e9, 3),
              f.attention_flops_min > 0 ? fixed(f.attention_flops_max / f.attention_flops_min, 3)
                                        : "inf (a rank has no heads)"});
  s << work.str();

  s << "\nTime per step [ms], measured; "
    << (r.measured_ranks.size() == 1 && o.sp > 1
            ? "rank " + std::to_string(r.measured_ranks[0]) + " alone on all cores (no peers)"
            : std::string("per step the slowest rank's"))
    << ", median over steps\n";
  Table time({"form", "forward", "backward", "grad all-reduce", "step", "in comm", "comm %",
              "tokens/s", "vs explicit"});
  for (const FormResult& f : r.results) {
    const bool timed = !o.count_only;
    time.add({to_string(f.form), timed ? fixed(f.forward_ms, 1) : "-",
              timed ? fixed(f.backward_ms, 1) : "-", timed ? fixed(f.sync_ms, 1) : "-",
              timed ? fixed(f.step_ms, 1) : "-", timed ? fixed(f.comm_ms, 1) : "-",
              timed && f.step_ms > 0 ? fixed(100 * f.comm_ms / f.step_ms, 1) : "-",
              f.tokens_per_s ? fixed(*f.tokens_per_s, 0) : "-",
              ex && f.tokens_per_s && ex->tokens_per_s
                  ? fixed(*f.tokens_per_s / *ex->tokens_per_s, 3) + "x"
                  : "-"});
  }
  s << time.str();
  if (o.rank_only < 0 && !o.count_only)
    s << "  tokens/s = B*S / step time of the slowest rank (forward + backward + gradient "
         "all-reduce).\n  in comm: that rank's wall time inside collectives and their waits "
         "(transfers, waiting for peers, --link's hold); comm % = in comm / step.\n";

  s << "\nAgreement with explicit at the same P (measured, " << to_string(r.options.precision)
    << "): max |diff| over the group\n";
  Table agr({"form", "out", "dx", "worst grad", "grad", "(scale: max |explicit grad|)"});
  for (const FormResult& f : r.results) {
    if (!f.agreement) {
      agr.add({to_string(f.form), "-", "-", "-", "-", "-"});
      continue;
    }
    const Agreement& a = *f.agreement;
    agr.add(
        {to_string(f.form), sci(a.out), sci(a.dx), a.worst_grad, sci(a.grads), sci(a.grads_ref)});
  }
  s << agr.str();
  s << "\nwall time " << fixed(r.wall_s, 1) << " s\n";
  return s.str();
}

std::string compare_json(const CompareResult& r) {
  const CompareOptions& o = r.options;
  ojson j;
  j["command"] = "compare";
  j["model_source"] = o.model.source();
  j["config"] = ojson::parse(r.cfg.to_json().dump());
  j["batch"] = r.layout.batch;
  j["seq"] = r.layout.seq;
  j["sp"] = r.layout.ranks;
  j["layout"] = r.layout.describe();
  j["attention"] = to_string(r.attention);
  j["doc_lens"] = r.documents ? ojson(r.documents->describe()) : ojson(nullptr);
  // The arithmetic: "f32", or "bf16" mixed precision, whose values are held
  // in fp32 tensors (element_bytes stays 4: the memory figures are fp32
  // storage's) and cross the wire as bf16 (wire_element_bytes: the
  // activation collectives at 2, the gradient all-reduce at 4; mla/wire.hpp).
  j["dtype"] = r.options.precision == Precision::bf16 ? "bf16" : "f32";
  j["element_bytes"] = 4;
  // bf16's attention kernel (kernels/attention_flash_bf16.hpp): avx512_bf16
  // allocates the per-call workspace each form reports, fp32 rounds into the
  // op layer's scratch instead.
  j["bf16_flash_isa"] =
      r.options.precision == Precision::bf16 ? ojson(to_string(flash_bf16_isa())) : ojson(nullptr);
  const WireElementBytes wire = wire_element_bytes(r.options.precision, r.options.grad_reduce, 4);
  j["wire_element_bytes"] = {{"activations", wire.activations}, {"gradients", wire.gradients}};
  j["comm"] = to_string(o.rank_only >= 0 ? Backend::dry_run : o.comm.backend);
  j["rank_only"] = o.rank_only >= 0 ? ojson(o.rank_only) : ojson(nullptr);
  j["count_only"] = o.count_only;
  j["measured_ranks"] = r.measured_ranks;
  j["ranks_aggregate"] = r.measured_ranks.size() == 1 ? "the one measured rank" : "max over ranks";
  j["steps"] = r.results.empty() ? 0 : r.results.front().step_ms_all.size();
  j["warmup"] = o.count_only ? 0 : o.warmup;
  j["threads_per_rank"] = r.threads_per_rank;
  j["seed"] = o.seed;
  j["values_meaningful"] = r.values_meaningful;
  j["notes"] = r.notes;
  j["units"] = {
      {"bytes", "bytes (integers)"}, {"time", "milliseconds"}, {"throughput", "tokens/s"}};
  const FormResult* ex = find_reference(r);
  ojson forms = ojson::array();
  for (const FormResult& f : r.results) {
    ojson g;
    g["form"] = to_string(f.form);
    g["bytes_sent_forward"] = f.sent_forward;
    g["predicted_bytes_sent_forward"] = f.predicted_forward;
    g["bytes_sent_backward"] = f.sent_backward;
    g["predicted_bytes_sent_backward"] = f.predicted_backward;
    g["bytes_sent_grad_sync"] = f.sent_grad_sync;
    g["predicted_bytes_sent_grad_sync"] = f.predicted_grad_sync;
    g["bytes_sent_total"] = f.sent_total;
    g["predicted_bytes_sent_total"] = f.predicted_total;
    g["bytes_received_total"] = f.received_total;
    g["bytes_match"] = f.bytes_match;
    ojson labels = ojson::array();
    for (const LabelRow& l : f.by_label)
      labels.push_back({{"phase", to_string(l.phase)},
                        {"label", l.label},
                        {"calls", l.calls},
                        {"bytes_sent", l.bytes_sent},
                        {"predicted_bytes_sent", l.predicted_sent},
                        {"bytes_received", l.bytes_received},
                        {"predicted_bytes_received", l.predicted_received},
                        {"match", l.match}});
    g["by_label"] = labels;
    g["peak_activation_bytes"] = f.peak;
    g["predicted_peak_activation_bytes"] = f.predicted_peak;
    g["memory_match"] = f.memory_match;
    g["memory_rel_error"] = f.memory_rel_error;
    g["peak_rank"] = f.peak_rank;
    g["peak_vs_explicit"] =
        ex && ex->peak > 0 ? ojson(double(f.peak) / double(ex->peak)) : ojson(nullptr);
    g["peak_activations_only_bytes"] = f.peak_activations;
    g["predicted_peak_activations_only_bytes"] = f.predicted_peak_activations;
    g["peak_comm_buffer_bytes"] = f.peak_comm_buffers;
    g["predicted_peak_comm_buffer_bytes"] = f.predicted_peak_comm_buffers;
    g["peak_grad_sync_bytes"] = f.peak_grad_sync;
    g["predicted_peak_grad_sync_bytes"] = f.predicted_peak_grad_sync;
    g["device_peak_bytes"] = f.device_peak;
    g["predicted_device_peak_bytes"] = f.predicted_device_peak;
    g["device_kept_predicted_bytes"] = f.device_kept_predicted;
    g["predicted_saved_after_forward_bytes"] = f.saved_after_forward;
    g["parameter_bytes"] = f.parameters;
    g["gradient_bytes"] = f.gradients;
    g["predicted_peak_at"] = f.model_peak.where;
    ojson live = ojson::array();
    for (const MemoryTerm& t : f.model_peak.live)
      live.push_back({{"name", t.name}, {"category", to_string(t.category)}, {"bytes", t.bytes}});
    g["predicted_live_at_peak"] = live;
    g["attention_flops_forward_max"] = f.attention_flops_max;
    g["attention_flops_forward_min"] = f.attention_flops_min;
    const bool timed = !o.count_only;
    g["forward_ms"] = timed ? ojson(f.forward_ms) : ojson(nullptr);
    g["backward_ms"] = timed ? ojson(f.backward_ms) : ojson(nullptr);
    g["grad_sync_ms"] = timed ? ojson(f.sync_ms) : ojson(nullptr);
    g["step_ms"] = timed ? ojson(f.step_ms) : ojson(nullptr);
    g["comm_ms"] = timed ? ojson(f.comm_ms) : ojson(nullptr);
    g["step_ms_per_step"] = timed ? ojson(f.step_ms_all) : ojson(nullptr);
    g["tokens_per_s"] = f.tokens_per_s ? ojson(*f.tokens_per_s) : ojson(nullptr);
    if (f.agreement) {
      const Agreement& a = *f.agreement;
      g["max_abs_diff"] = {{"against", "explicit at the same P"},
                           {"out", a.out},
                           {"dx", a.dx},
                           {"grad", a.grads},
                           {"worst_grad", a.worst_grad},
                           {"out_scale", a.out_ref},
                           {"dx_scale", a.dx_ref},
                           {"grad_scale", a.grads_ref}};
    } else {
      g["max_abs_diff"] = nullptr;
    }
    forms.push_back(g);
  }
  j["forms"] = forms;
  j["wall_s"] = r.wall_s;
  return j.dump(2) + "\n";
}

std::string compare_csv(const CompareResult& r) {
  std::ostringstream s;
  s << "form,batch,seq,sp,attention,rank_only,count_only,bytes_sent_forward,"
       "predicted_bytes_sent_forward,bytes_sent_backward,predicted_bytes_sent_backward,"
       "bytes_sent_grad_sync,bytes_sent_total,predicted_bytes_sent_total,bytes_match,"
       "peak_activation_bytes,predicted_peak_activation_bytes,memory_match,"
       "peak_activations_only_bytes,peak_comm_buffer_bytes,peak_grad_sync_bytes,parameter_bytes,"
       "gradient_bytes,forward_ms,backward_ms,grad_sync_ms,step_ms,tokens_per_s,max_abs_diff_out,"
       "max_abs_diff_dx,max_abs_diff_grad\n";
  const CompareOptions& o = r.options;
  auto opt = [](bool has, double v) { return has ? cat(v) : std::string(); };
  for (const FormResult& f : r.results) {
    const bool timed = !o.count_only;
    const bool a = f.agreement.has_value();
    s << to_string(f.form) << "," << r.layout.batch << "," << r.layout.seq << "," << r.layout.ranks
      << "," << to_string(r.attention) << "," << (o.rank_only >= 0 ? cat(o.rank_only) : "") << ","
      << (o.count_only ? "true" : "false") << "," << f.sent_forward << "," << f.predicted_forward
      << "," << f.sent_backward << "," << f.predicted_backward << "," << f.sent_grad_sync << ","
      << f.sent_total << "," << f.predicted_total << "," << (f.bytes_match ? "true" : "false")
      << "," << f.peak << "," << f.predicted_peak << "," << (f.memory_match ? "true" : "false")
      << "," << f.peak_activations << "," << f.peak_comm_buffers << "," << f.peak_grad_sync << ","
      << f.parameters << "," << f.gradients << "," << opt(timed, f.forward_ms) << ","
      << opt(timed, f.backward_ms) << "," << opt(timed, f.sync_ms) << "," << opt(timed, f.step_ms)
      << "," << opt(f.tokens_per_s.has_value(), f.tokens_per_s.value_or(0)) << ","
      << opt(a, a ? f.agreement->out : 0) << "," << opt(a, a ? f.agreement->dx : 0) << ","
      << opt(a, a ? f.agreement->grads : 0) << "\n";
  }
  return s.str();
}

}  // namespace laga::tools
