#include "tools/plan_model_report.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "mla/form_registry.hpp"

namespace laga::tools {

namespace {

using ojson = nlohmann::ordered_json;

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string gb(double bytes) {  // 10^9 bytes
  return fmt("%.3f", bytes / 1e9);
}

// Each pipeline device's layers, per-micro-batch pass times and memory.
ojson stages_json(const ModelPlan& f) {
  ojson a = ojson::array();
  for (const StagePlan& s : f.stages) {
    ojson spans = ojson::array();
    for (const StageSpan& p : s.spans)
      spans.push_back({{"first_layer", p.first_layer},
                       {"layers", p.layers},
                       {"embedding", p.embedding},
                       {"head", p.head},
                       {"mtp_modules", p.mtp_modules}});
    a.push_back({{"spans", spans},
                 {"forward_s", s.pass.forward},
                 {"backward_s", s.pass.backward},
                 {"weight_grad_s", s.pass.weight_grad},
                 {"forward_comm_s", s.pass.forward_comm},
                 {"backward_comm_s", s.pass.backward_comm},
                 {"in_flight_micro_batches", s.in_flight},
                 {"state_bytes", s.state.total()},
                 {"activation_bytes", s.activations.total()},
                 {"memory_bytes", s.memory_bytes()}});
  }
  return a;
}

}  // namespace

// The whole model's step (--model): per (S, P, DP) and form, the predicted
// step, its parts, the memory per device and whether it fits.
std::string model_table(const ModelPlanRequest& q, const ModelPlanResult& r) {
  const LmConfig& m = q.model;
  const ModelParamCounts n = model_param_counts(m);
  std::int64_t moe_layers = 0;
  for (std::int64_t l = 0; l < m.layers; ++l) moe_layers += m.is_moe_layer(l) ? 1 : 0;
  std::ostringstream o;
  o << "laga plan --model: " << m.layers << " layers (" << m.layers - moe_layers << " dense, "
    << moe_layers << " MoE), D " << m.dim() << ", vocab " << m.vocab;
  if (m.moe) o << ", " << m.moe->summary();
  o << "; " << fmt("%.4g", double(n.total()) / 1e9) << "B parameters ("
    << fmt("%.4g", double(n.routed_experts) / 1e9) << "B in routed experts)\n";
  o << "  " << q.block.profile.name << " (" << q.block.profile.source << "), "
    << to_string(q.block.dtype) << " (gradients " << to_string(q.block.grad_reduce) << "), "
    << to_string(q.block.attention) << " attention, batch " << q.block.batch << ", "
    << to_string(q.block.seq_layout) << " seq shards, "
    << (q.global_batch_tokens > 0
            ? cat("a global batch of ", q.global_batch_tokens,
                  " tokens a step (micro-batches a replica: that / (S x batch x DP))")
            : cat(q.micro_batches, " micro-batch(es) a step"))
    << "; one training step, predicted; EP "
    << (q.ep.rule == EpRule::sp    ? std::string("= P (experts over the SP ranks)")
        : q.ep.rule == EpRule::max ? std::string("= gcd(P x DP, E) (experts over the replicas too)")
                                   : cat("= ", q.ep.degree))
    << "; "
    << "ZeRO-1 " << (q.zero1 ? "on" : "off") << "; recompute " << (q.recompute ? "on" : "off")
    << "; GEMMs " << (q.fp8 ? "fp8 (the layers' linears; head and gate bf16)" : "in the dtype")
    << "; routing "
    << (q.node_limit > 0
            ? cat("node-limited (at most ", q.node_limit, " nodes a token, sent once a node)")
            : std::string("per copy"))
    << "; pipeline " << to_string(q.pipeline.schedule)
    << (q.pipeline.schedule == PipeSchedule::interleaved ? cat(" x", q.pipeline.chunks) : "")
    << (q.pipeline.mtp ? ", MTP module on the last stage" : "")
    << "; no overlap between attention, MoE and gradient collectives"
    << (q.pipeline.schedule == PipeSchedule::dualpipe ? " but DualPipe's (F&B pairs)" : "") << "\n";
  o << "  attention: the one-block plan per layer (its timeline); FFN and head GEMMs by shape, "
       "at each shape's measured time where the profile has it, else at peak x "
    << fmt("%.3g", q.block.profile.device.gemm_efficiency)
    << "; MoE all-to-alls: the mean bytes under uniform routing on the link model; "
       "elementwise: bytes at "
    << fmt("%.3g", q.block.profile.device.elementwise_bytes_per_s / 1e9) << " GB/s"
    << (q.block.profile.device.exp_per_s > 0
            ? cat(", exponentials at ", fmt("%.3g", q.block.profile.device.exp_per_s), "/s")
            : std::string(", exponentials not priced (the profile has no exp_per_s)"))
    << "\n";
  for (const ModelPlanCase& c : r.cases) {
    o << "\nS " << c.seq << ", P " << c.sp << ", DP " << c.dp << ", PP " << c.pp << ", EP "
      << (c.forms.empty() ? 0 : c.forms.front().ep) << ": " << c.devices() << " device(s) on "
      << c.nodes << " node(s)\n";
    char line[320];
    std::snprintf(line, sizeof line, "  %-22s %10s %12s %6s %6s %6s %10s %9s %9s %9s %6s\n", "form",
                  "step s", "tok/s/dev", "MFU%", "attn%", "a2a%", "a2a GB/rk", "state GB", "act GB",
                  "mem GB", "fits");
    o << line;
    for (const ModelPlan& f : c.forms) {
      std::snprintf(
          line, sizeof line, "  %-22s %10.4g %12.4g %6.1f %6.1f %6.1f %10s %9s %9s %9s %6s\n",
          to_string(f.form).c_str(), f.step_s, f.tokens_per_s_per_device, 100 * f.mfu,
          100 * f.attention_share, 100 * f.time.moe_a2a / f.step_s,
          gb(f.moe_a2a_bytes_per_rank).c_str(), gb(f.state.total()).c_str(),
          gb(f.activations.total()).c_str(), gb(f.memory_bytes()).c_str(), f.fits ? "yes" : "NO");
      o << line;
      if (f.pp > 1 || !f.stages.empty()) {
        const ModelStepTime& t = f.time;
        o << "    slowest pipeline device " << f.slowest_stage << " of " << f.pp
          << ", s: attention " << fmt("%.4g", t.attention) << ", ffn " << fmt("%.4g", t.ffn)
          << ", a2a " << fmt("%.4g", t.moe_a2a) << ", head " << fmt("%.4g", t.head)
          << ", elementwise " << fmt("%.4g", t.elementwise) << ", p2p " << fmt("%.4g", t.p2p)
          << ", bubble " << fmt("%.4g", t.bubble) << ", SMs to comm " << fmt("%.4g", t.comm_units)
          << ", hidden -" << fmt("%.4g", t.hidden) << ", grad sync " << fmt("%.4g", t.grad_sync)
          << ", AdamW " << fmt("%.4g", t.optimizer) << "; a2a over nodes "
          << gb(f.moe_a2a_inter_node_bytes_per_rank) << " GB/rk; "
          << fmt("%.4g", 1e12 / f.tokens_per_s_per_device / 3600 / 1e3)
          << "K device-hours per 10^12 tokens\n";
      }
    }
    if (c.winner >= 0) {
      const ModelPlan& w = c.forms[size_t(c.winner)];
      o << "  winner: " << to_string(w.form);
      for (const ModelPlan& f : c.forms)
        if (f.form.form == reference_form() && w.form.form != reference_form())
          o << " (" << fmt("%.4f", f.step_s / w.step_s) << "x " << to_string(f.form.form)
            << "'s speed)";
      o << "\n";
    } else {
      o << "  winner: none fits " << gb(q.block.profile.device.memory_bytes)
        << " GB of device memory\n";
    }
  }
  o << "\nfewest devices that fit (of the --sp x --dp x --pp grid planned):\n";
  for (const MinDevices& d : r.min_devices) {
    if (d.found)
      o << "  S " << d.seq << ": " << d.sp * d.dp * d.pp << " (P " << d.sp << " x DP " << d.dp
        << " x PP " << d.pp << ", " << to_string(d.form) << ")\n";
    else
      o << "  S " << d.seq << ": none of the grid fits\n";
  }
  o << "\nstep s: the slowest device's step (predicted); MFU: model FLOPs (attention as the "
       "reference form counts it, every rank; FFN 2*3*D*width per token and expert copy; head "
       "2*D*V; backward 2x forward) / (devices x peak x step); attn%, a2a%: shares of the step; "
       "a2a GB/rk: EP bytes sent per rank and step; state: parameters + gradients + AdamW ("
    << (q.block.dtype == PlanDType::bf16
            ? cat("bf16 params, ", to_string(q.block.grad_reduce), " grads, fp32 master, m, v")
            : std::string("fp32 params, grads, m, v"))
    << "); act: saved activations + the largest working set; fits: state + act <= "
    << gb(q.block.profile.device.memory_bytes) << " GB\n";
  return o.str();
}

std::string model_json(const ModelPlanRequest& q, const ModelPlanResult& r) {
  const ModelParamCounts n = model_param_counts(q.model);
  ojson j;
  j["profile"] = q.block.profile.name;
  j["profile_source"] = q.block.profile.source;
  j["dtype"] = to_string(q.block.dtype);
  j["grad_reduce"] = to_string(q.block.grad_reduce);
  j["attention"] = to_string(q.block.attention);
  j["batch"] = q.block.batch;
  j["micro_batches"] = q.micro_batches;
  j["global_batch_tokens"] = q.global_batch_tokens;
  j["model"] = q.model.summary();
  j["layers"] = q.model.layers;
  j["parameters"] = {{"total", n.total()},
                     {"replicated", n.replicated()},
                     {"attention", n.attention},
                     {"norms", n.norms},
                     {"dense_ffn", n.dense_ffn},
                     {"gate", n.gate},
                     {"shared_experts", n.shared_experts},
                     {"routed_experts", n.routed_experts},
                     {"embedding", n.embedding},
                     {"head", n.head}};
  j["zero1"] = q.zero1;
  j["recompute"] = q.recompute;
  j["fp8"] = q.fp8;
  j["node_limit"] = q.node_limit;
  j["schedule"] = to_string(q.pipeline.schedule);
  j["mtp"] = q.pipeline.mtp;
  j["plans"] = ojson::array();
  j["cases"] = ojson::array();
  for (const ModelPlanCase& c : r.cases) {
    for (const ModelPlan& f : c.forms)
      j["plans"].push_back(
          {{"form", to_string(f.form)},
           {"seq", c.seq},
           {"sp", c.sp},
           {"dp", c.dp},
           {"pp", c.pp},
           {"ep", f.ep},
           {"devices", c.devices()},
           {"predicted_step_s", f.step_s},
           {"predicted_tokens_per_s_per_device", f.tokens_per_s_per_device},
           {"model_flops", f.model_flops},
           {"mfu", f.mfu},
           {"attention_share", f.attention_share},
           {"seconds",
            {{"attention", f.time.attention},
             {"ffn", f.time.ffn},
             {"moe_a2a", f.time.moe_a2a},
             {"head", f.time.head},
             {"elementwise", f.time.elementwise},
             {"grad_sync", f.time.grad_sync},
             {"optimizer", f.time.optimizer},
             {"p2p", f.time.p2p},
             {"bubble", f.time.bubble},
             {"comm_units", f.time.comm_units},
             {"hidden", -f.time.hidden}}},
           {"slowest_stage", f.slowest_stage},
           {"device_hours_per_1e12_tokens", 1e12 / f.tokens_per_s_per_device / 3600},
           {"moe_a2a_bytes_per_rank", f.moe_a2a_bytes_per_rank},
           {"moe_a2a_inter_node_bytes_per_rank", f.moe_a2a_inter_node_bytes_per_rank},
           {"p2p_bytes_per_rank", f.p2p_bytes_per_rank},
           {"stages", stages_json(f)},
           {"memory",
            {{"parameters", f.state.parameters},
             {"gradients", f.state.gradients},
             {"optimizer", f.state.optimizer},
             {"activations", f.activations.total()},
             {"total", f.memory_bytes()}}},
           {"block_step_s", f.block.step_s},
           {"fits", f.fits}});
    j["cases"].push_back(
        {{"seq", c.seq},
         {"sp", c.sp},
         {"dp", c.dp},
         {"pp", c.pp},
         {"micro_batches", c.micro_batches},
         {"nodes", c.nodes},
         {"winner",
          c.winner >= 0 ? ojson(to_string(c.forms[size_t(c.winner)].form)) : ojson(nullptr)}});
  }
  j["min_devices"] = ojson::array();
  for (const MinDevices& d : r.min_devices)
    j["min_devices"].push_back(d.found ? ojson{{"seq", d.seq},
                                               {"devices", d.sp * d.dp * d.pp},
                                               {"sp", d.sp},
                                               {"dp", d.dp},
                                               {"pp", d.pp},
                                               {"form", to_string(d.form)}}
                                       : ojson{{"seq", d.seq}, {"devices", nullptr}});
  return j.dump(2) + "\n";
}

}  // namespace laga::tools
