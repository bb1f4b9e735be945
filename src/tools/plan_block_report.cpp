// `laga plan`'s table and JSON for the block's forms (docs/planning.md):
// what cmd_plan.cpp prints and writes for a block plan, and the number
// formats the plan's messages share.
#include "tools/plan_block_report.hpp"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "mla/form_registry.hpp"
#include "mla/work_model.hpp"

namespace laga::tools {

std::string plan_number(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string plan_gb(double bytes) {
  return plan_number("%.3f", bytes / 1e9);
}

namespace {

using ojson = nlohmann::ordered_json;

std::string link_text(const LinkModel& l) {
  return cat(plan_number("%.4g", l.bytes_per_s / 1e9), " GB/s ",
             plan_number("%.3g", l.latency_s * 1e6), " us ", to_string(l.topology));
}

std::string crossover_text(const Crossover& c) {
  const std::string laga = to_string(c.laga);
  if (c.found)
    return cat("crossover: ", laga, " ", c.laga_wins_above ? "beats" : "loses to",
               " explicit above ", plan_number("%.4g", c.bytes_per_s / 1e9),
               " GB/s per link (every link at that bandwidth, latencies as planned); ",
               c.laga_wins_above ? "explicit" : laga, " is faster below it");
  return cat("crossover: none between ", plan_number("%.3g", c.scanned_low / 1e9), " and ",
             plan_number("%.3g", c.scanned_high / 1e9), " GB/s per link; ", laga, " is ",
             c.laga_wins_throughout ? "faster" : "slower", " than explicit throughout");
}

// How the GEMM and attention calls were costed: at their shapes' measured
// times, at the profile's efficiency, or some of each.
std::string measured_share(const PlanRequest& q, const std::vector<PlanCase>& cases) {
  double flops = 0, unmeasured = 0;
  for (const PlanCase& c : cases)
    for (const FormPlan& f : c.forms)
      for (const PhaseTime& p : f.phases)
        flops += p.compute.flops, unmeasured += p.compute.unmeasured_flops;
  const std::string efficiency =
      cat("GEMM and attention FLOPs at the profile's efficiency (gemm ",
          plan_number("%.3g", q.profile.device.gemm_efficiency), ", attention ",
          plan_number("%.3g", q.profile.device.attention_efficiency), " of peak)");
  if (unmeasured >= flops) return "all " + efficiency;
  if (unmeasured == 0) return "every GEMM and attention call at its shape's measured time";
  return cat(plan_number("%.1f", 100 * (1 - unmeasured / flops)),
             "% of the GEMM and attention FLOPs at their shapes' measured times, the rest ",
             efficiency);
}

// On contiguous shards the forms that attend their own tokens' queries
// (the work model's balance, not their names) leave the last rank about
// 2P - 1 times the first's causal work; the note names them and the layout
// that evens it, as TransformerEngine runs its rings.
std::string unbalanced_note(const PlanRequest& q) {
  if (q.seq_layout != SeqLayout::contiguous || q.seqs.empty() || q.sps.empty()) return "";
  const int P = *std::max_element(q.sps.begin(), q.sps.end());
  const std::int64_t S = *std::max_element(q.seqs.begin(), q.seqs.end());
  if (P < 2 || S < P) return "";
  const SpLayout contiguous = SpLayout::even(q.batch, S, q.cfg.n_heads, P);
  const SpLayout zigzag = SpLayout::even(q.batch, S, q.cfg.n_heads, P, SeqLayout::zigzag);
  std::vector<Form> forms;
  double worst = 0;  // the first such form's max/min
  for (FormVariant v : q.forms) {
    const double balance = attention_balance(q.cfg, contiguous, v, nullptr);
    if (balance > 2 * attention_balance(q.cfg, zigzag, v, nullptr) &&
        std::find(forms.begin(), forms.end(), v.form) == forms.end()) {
      if (forms.empty()) worst = balance;
      forms.push_back(v.form);
    }
  }
  if (forms.empty()) return "";
  return cat("  note: ", names_of(forms),
             " attend their own tokens' queries: on these contiguous shards the ",
             "last rank does most of the causal work (", forms.size() > 1 ? "the first's" : "its",
             " max/min ", plan_number("%.3g", worst), " at S ", S, ", P ", P,
             "); --seq-layout zigzag plans them on the load-balanced layout ",
             "TransformerEngine and Megatron run\n");
}

// The slowest rank's seconds per phase, by kind: what the step is made of.
ojson phases_json(const FormPlan& f) {
  ojson j = ojson::object();
  for (size_t ph = 0; ph < f.phases.size(); ++ph) {
    const PhaseTime& p = f.phases[ph];
    j[to_string(static_cast<Phase>(ph))] = {{"gemm_s", p.compute.gemm_s},
                                            {"attention_s", p.compute.attention_s},
                                            {"elementwise_s", p.compute.elementwise_s},
                                            {"comm_s", p.comm_s},
                                            {"gemm_flops", p.compute.gemm_flops},
                                            {"attention_flops", p.compute.attention_flops},
                                            {"unmeasured_flops", p.compute.unmeasured_flops}};
  }
  return j;
}

}  // namespace

std::string plan_table(const PlanRequest& q, const std::vector<PlanCase>& cases) {
  std::ostringstream o;
  o << "laga plan: " << q.profile.name << " (" << q.profile.source << "), " << to_string(q.dtype)
    << " (gradients " << to_string(q.grad_reduce) << "), " << to_string(q.attention)
    << " attention, batch " << q.batch << ", " << to_string(q.seq_layout)
    << " seq shards; one MLA block, forward + backward + gradient all-reduce, predicted\n";
  o << "  timeline: each rank's collectives in issue order on one link, the compute between "
       "them at the costs below; a collective runs once every rank has issued it; a started "
       "collective (+overlap) holds the rank only at its wait"
    << (q.profile.shared_cores > 0
            ? cat("; the ranks share ", q.profile.shared_cores,
                  " cores, those computing at once each at min(1, cores / n) of one")
            : "")
    << "\n";
  o << "  compute: " << measured_share(q, cases) << "\n";
  o << unbalanced_note(q);
  for (const PlanCase& c : cases) {
    o << "\nS " << c.seq << ", P " << c.sp << ": " << c.links.nodes << " node(s), "
      << (c.links.nodes > 1 ? c.links.fabric.ranks_per_node : c.sp) << " rank(s) per node; intra "
      << link_text(c.links.fabric.intra);
    if (c.links.nodes > 1) o << "; inter " << link_text(c.links.fabric.inter);
    o << "\n";
    char line[256];
    std::snprintf(line, sizeof line, "  %-22s %12s %12s %10s %12s %6s %8s %10s %10s %10s %12s\n",
                  "form", "sent/rank GB", "peak act GB", "step s", "tokens/s", "comm%", "fits",
                  "compute s", "hidden s", "waits s", "cross-node GB");
    o << line;
    for (const FormPlan& f : c.forms) {
      double compute = 0;
      for (const PhaseTime& p : f.phases) compute += p.compute_s();
      std::snprintf(line, sizeof line,
                    "  %-22s %12s %12s %10.4g %12.4g %6.1f %8s %10.4g %10.4g %10.4g %12s\n",
                    to_string(f.form).c_str(), plan_gb(double(f.bytes_sent_per_rank)).c_str(),
                    plan_gb(double(f.peak_activation_bytes)).c_str(), f.step_s, f.tokens_per_s,
                    100 * f.comm_fraction, f.fits ? "yes" : "NO", compute, f.hidden_comm_s,
                    f.peer_wait_s + f.core_share_s, plan_gb(f.crossing_bytes).c_str());
      o << line;
    }
    if (c.winner >= 0) {
      const FormPlan& w = c.forms[size_t(c.winner)];
      o << "  winner: " << to_string(w.form);
      for (const FormPlan& f : c.forms)
        if (f.form.form == reference_form() && w.form.form != reference_form())
          o << " (" << plan_number("%.3f", w.tokens_per_s / f.tokens_per_s) << "x "
            << to_string(f.form.form) << "'s tokens/s)";
      o << "\n";
    } else {
      o << "  winner: none fits " << plan_gb(q.profile.device.memory_bytes)
        << " GB of device memory (peak activations + the block's parameters and gradients)\n";
    }
    if (c.crossover) o << "  " << crossover_text(*c.crossover) << "\n";
  }
  o << "\nbytes: per rank, max over ranks, all phases (laga compare's bytes_sent_total); peak "
       "act: forward+backward activations + comm buffers (its peak_activation_bytes); fits: peak "
       "+ parameters + gradients <= "
    << plan_gb(q.profile.device.memory_bytes)
    << " GB; comm%: the share of the step spent waiting for links; hidden s: communication "
       "under compute (overlap)\n";
  return o.str();
}

std::string plan_json(const PlanRequest& q, const std::vector<PlanCase>& cases) {
  ojson j;
  j["profile"] = q.profile.name;
  j["profile_source"] = q.profile.source;
  j["dtype"] = to_string(q.dtype);
  j["grad_reduce"] = to_string(q.grad_reduce);
  j["attention"] = to_string(q.attention);
  j["batch"] = q.batch;
  j["seq_layout"] = to_string(q.seq_layout);
  j["overlap"] = "timeline";  // started collectives hidden under compute (time_model.hpp)
  j["plans"] = ojson::array();
  j["cases"] = ojson::array();
  for (const PlanCase& c : cases) {
    for (const FormPlan& f : c.forms)
      j["plans"].push_back({{"form", to_string(f.form)},
                            {"seq", c.seq},
                            {"sp", c.sp},
                            {"bytes_sent_per_rank", f.bytes_sent_per_rank},
                            {"bytes_sent_forward", f.bytes_sent_forward},
                            {"bytes_sent_backward", f.bytes_sent_backward},
                            {"peak_activation_bytes", f.peak_activation_bytes},
                            {"predicted_step_s", f.step_s},
                            {"predicted_tokens_per_s", f.tokens_per_s},
                            {"comm_fraction", f.comm_fraction},
                            {"hidden_comm_s", f.hidden_comm_s},
                            {"peer_wait_s", f.peer_wait_s},
                            {"core_share_s", f.core_share_s},
                            {"critical_rank", f.critical_rank},
                            {"phases", phases_json(f)},
                            {"fits", f.fits}});
    ojson k = {{"seq", c.seq},
               {"sp", c.sp},
               {"nodes", c.links.nodes},
               {"winner",
                c.winner >= 0 ? ojson(to_string(c.forms[size_t(c.winner)].form)) : ojson(nullptr)}};
    if (c.crossover) {
      k["crossover_bytes_per_s"] =
          c.crossover->found ? ojson(c.crossover->bytes_per_s) : ojson(nullptr);
      k["crossover"] = crossover_text(*c.crossover);
    }
    j["cases"].push_back(k);
  }
  return j.dump(2) + "\n";
}
}  // namespace laga::tools
