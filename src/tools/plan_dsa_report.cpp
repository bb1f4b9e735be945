#include "tools/plan_dsa_report.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"

namespace laga::tools {

namespace {
using ojson = nlohmann::ordered_json;
std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / 1e9);
  return b;
}
}  // namespace

std::string dsa_table(const DsaPlanRequest& q, const std::vector<DsaPlanCase>& cases) {
  std::ostringstream o;
  o << "laga plan (DSA): " << q.profile.name << " (" << q.profile.source << "), "
    << to_string(q.dtype) << " (gradients " << to_string(q.grad_reduce) << "), batch " << q.batch
    << ", " << to_string(q.seq_layout) << " seq shards; one MLA block with DeepSeek's lightning "
    << "indexer (index_n_heads " << q.dsa.index_n_heads << ", index_head_dim "
    << q.dsa.index_head_dim << ", index_topk " << q.dsa.index_topk
    << "), forward + backward (sparse stage: the indexer's KL over the selected keys, its input "
       "detached) + gradient all-reduce\n"
    << "  closed forms (mla/dsa_model.hpp); the forms' registry rows (DsaFormTraits):\n";
  for (DsaForm f : all_dsa_forms()) {
    const DsaFormTraits& t = dsa_form_traits(f);
    o << "    " << t.name << ": moves " << t.moves << "; "
      << (t.runner ? cat("run by ", t.runner,
                         " (laga forward/compare on this config), its ledger equal to the closed "
                         "form")
                   : std::string("not run by the engine: the closed form alone"))
      << "\n";
  }
  o << "  peak act is dsa_memory: the running forms' pool peaks exactly (their count-only "
       "runs, laga compare --count-only; the forms' tensors fp32 under bf16 plus the "
       "attention's bf16 operand copies), ring_latent's a closed form from the math; "
       "step predicted: the slowest rank's GEMM FLOPs at "
    << q.profile.device.gemm_efficiency << " and attention + indexer FLOPs at "
    << q.profile.device.attention_efficiency
    << " of the peak, plus its collectives one after another at the link model, none hidden\n";
  for (const DsaPlanCase& c : cases) {
    o << "\nS " << c.seq << ", P " << c.sp << ": " << c.links.nodes << " node(s)\n";
    char line[320];
    std::snprintf(line, sizeof line, "  %-16s %12s %12s %12s %12s %10s %12s %6s %6s %10s\n", "form",
                  "sent/rank GB", "index GB", "peak act GB", "indexer TF", "step s", "tokens/s",
                  "comm%", "fits", "compute s");
    o << line;
    for (const DsaFormPlan& f : c.forms) {
      std::snprintf(line, sizeof line,
                    "  %-16s %12s %12s %12s %12.4g %10.4g %12.4g %6.1f %6s %10.4g\n",
                    to_string(f.form), gb(double(f.bytes_sent_per_rank)).c_str(),
                    gb(double(f.index_bytes_sent)).c_str(),
                    gb(double(f.peak_activation_bytes)).c_str(), f.indexer_flops / 1e12, f.step_s,
                    f.tokens_per_s, 100 * f.comm_fraction, f.fits ? "yes" : "NO", f.compute_s);
      o << line;
    }
    if (c.winner >= 0)
      o << "  winner: " << to_string(c.forms[size_t(c.winner)].form) << "\n";
    else
      o << "  winner: none fits " << gb(q.profile.device.memory_bytes) << " GB of device memory\n";
  }
  o << "\nsent/rank: max over ranks, all phases; index: of those, the indexer's (index keys, "
       "weights, top-k indices as int32, the KL target as fp32); peak act: what the form saves "
       "for backward plus backward's largest working set, max over ranks; indexer TF: the "
       "slowest rank's indexer TFLOPs, forward + backward; fits: peak + parameters + gradients "
       "<= "
    << gb(q.profile.device.memory_bytes) << " GB\n";
  return o.str();
}

std::string dsa_json(const DsaPlanRequest& q, const std::vector<DsaPlanCase>& cases) {
  ojson j;
  j["profile"] = q.profile.name;
  j["dtype"] = to_string(q.dtype);
  j["grad_reduce"] = to_string(q.grad_reduce);
  j["batch"] = q.batch;
  j["seq_layout"] = to_string(q.seq_layout);
  j["dsa"] = {{"index_n_heads", q.dsa.index_n_heads},
              {"index_head_dim", q.dsa.index_head_dim},
              {"index_topk", q.dsa.index_topk}};
  j["plans"] = ojson::array();
  j["cases"] = ojson::array();
  for (const DsaPlanCase& c : cases) {
    for (const DsaFormPlan& f : c.forms)
      j["plans"].push_back({{"form", to_string(f.form)},
                            {"seq", c.seq},
                            {"sp", c.sp},
                            {"bytes_sent_per_rank", f.bytes_sent_per_rank},
                            {"bytes_sent_forward", f.bytes_sent_forward},
                            {"bytes_sent_backward", f.bytes_sent_backward},
                            {"index_bytes_sent", f.index_bytes_sent},
                            {"peak_activation_bytes", f.peak_activation_bytes},
                            {"saved_bytes", f.saved_bytes},
                            {"peak_where", f.peak_where},
                            {"gemm_flops", f.gemm_flops},
                            {"attention_flops", f.attention_flops},
                            {"indexer_flops", f.indexer_flops},
                            {"compute_s", f.compute_s},
                            {"comm_s", f.comm_s},
                            {"predicted_step_s", f.step_s},
                            {"predicted_tokens_per_s", f.tokens_per_s},
                            {"comm_fraction", f.comm_fraction},
                            {"fits", f.fits}});
    j["cases"].push_back(
        {{"seq", c.seq},
         {"sp", c.sp},
         {"nodes", c.links.nodes},
         {"winner",
          c.winner >= 0 ? ojson(to_string(c.forms[size_t(c.winner)].form)) : ojson(nullptr)}});
  }
  return j.dump(2) + "\n";
}

}  // namespace laga::tools
