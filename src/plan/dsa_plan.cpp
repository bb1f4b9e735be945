#include "plan/dsa_plan.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "mla/params.hpp"

namespace laga {

bool dsa_index_label(const std::string& label) {
  return label == "index_k_ag" || label == "index_w_ag" || label == "topk_ag" ||
         label == "index_target_rs" || label == "index_k_ring" || label == "dindex_k_ring";
}

namespace {

// One rank's collectives one after another: each label's calls at the
// link model, its bytes split evenly over its calls.
double comm_seconds(const CommPrediction& comm, int P, const Fabric& fabric) {
  double s = 0;
  for (const auto& [key, b] : comm) {
    if (b.calls == 0 || (b.sent == 0 && b.received == 0)) continue;
    const WireBytes per_call{b.sent / b.calls, b.received / b.calls};
    s += double(b.calls) * collective_seconds(b.kind, P, per_call, fabric);
  }
  return s;
}

}  // namespace

std::vector<DsaPlanCase> make_dsa_plans(const DsaPlanRequest& q) {
  LAGA_CHECK(!q.seqs.empty() && !q.sps.empty() && !q.forms.empty(),
             "plan: need at least one --seq, one --sp and one DSA form");
  q.dsa.validate(q.cfg);
  check_grad_reduce(precision_of(q.dtype), q.grad_reduce);
  for (std::int64_t S : q.seqs)
    for (int P : q.sps)
      LAGA_CHECK(P <= S, "--sp ", P, " is more ranks than the ", S, " tokens of --seq ", S,
                 ": every rank needs at least one token; give --sp <= ", S);
  std::int64_t params = q.dsa.parameter_count(q.cfg);
  for (const auto& [name, shape] : mla_param_shapes(q.cfg)) params += numel(shape);
  const std::int64_t e = element_bytes(q.dtype);
  const RunDtype run_dtype =
      precision_of(q.dtype) == Precision::bf16 ? RunDtype::bf16 : RunDtype::fp32;
  const std::int64_t resident = params * (e + gradient_bytes(q.dtype, q.grad_reduce));
  const WireElementBytes wire = wire_element_bytes(precision_of(q.dtype), q.grad_reduce, e);
  const double peak = q.profile.peak_flops(q.dtype);
  const double gemm_rate = peak * q.profile.device.gemm_efficiency;
  const double attention_rate = peak * q.profile.device.attention_efficiency;
  std::vector<DsaPlanCase> cases;
  for (std::int64_t S : q.seqs) {
    for (int P : q.sps) {
      DsaPlanCase pc;
      pc.seq = S, pc.sp = P;
      pc.links = plan_links(q.profile, P, q.nodes, q.link_bytes_per_s, q.link_latency_s);
      const SpLayout layout = SpLayout::even(q.batch, S, q.cfg.n_heads, P, q.seq_layout);
      for (DsaForm form : q.forms) {
        DsaFormPlan fp;
        fp.form = form;
        fp.resident_bytes = resident;
        double slowest_compute = -1;
        for (int r = 0; r < P; ++r) {
          const CommPrediction comm = dsa_predict_comm(q.cfg, q.dsa, layout, form, r, wire,
                                                       /*backward=*/true, /*grad_sync=*/true);
          std::int64_t index_sent = 0;
          for (const auto& [key, b] : comm)
            if (dsa_index_label(key.second)) index_sent += b.sent;
          fp.bytes_sent_per_rank = std::max(fp.bytes_sent_per_rank, predicted_sent(comm));
          fp.bytes_sent_forward =
              std::max(fp.bytes_sent_forward, predicted_sent(comm, Phase::forward));
          fp.bytes_sent_backward =
              std::max(fp.bytes_sent_backward, predicted_sent(comm, Phase::backward));
          fp.index_bytes_sent = std::max(fp.index_bytes_sent, index_sent);
          fp.comm_s = std::max(fp.comm_s, comm_seconds(comm, P, pc.links.fabric));
          const DsaMemory m = dsa_memory(q.cfg, q.dsa, layout, form, r, run_dtype);
          if (m.peak > fp.peak_activation_bytes)
            fp.peak_activation_bytes = m.peak, fp.peak_where = m.peak_where;
          fp.saved_bytes = std::max(fp.saved_bytes, m.saved);
          const DsaRankWork w = dsa_work(q.cfg, q.dsa, layout, form, r);
          const double gemm = w.forward.gemm_flops + w.backward.gemm_flops;
          const double attention = w.forward.attention_flops + w.backward.attention_flops;
          const double indexer = w.forward.indexer_flops + w.backward.indexer_flops;
          const double compute = gemm / gemm_rate + (attention + indexer) / attention_rate;
          if (compute > slowest_compute) {
            slowest_compute = compute;
            fp.gemm_flops = gemm, fp.attention_flops = attention, fp.indexer_flops = indexer;
          }
        }
        fp.compute_s = slowest_compute;
        fp.step_s = fp.compute_s + fp.comm_s;
        fp.comm_fraction = fp.step_s > 0 ? fp.comm_s / fp.step_s : 0;
        fp.tokens_per_s = fp.step_s > 0 ? double(q.batch * S) / fp.step_s : 0;
        fp.fits = double(fp.peak_activation_bytes + resident) <= q.profile.device.memory_bytes;
        pc.forms.push_back(fp);
      }
      for (size_t i = 0; i < pc.forms.size(); ++i)
        if (pc.forms[i].fits &&
            (pc.winner < 0 || pc.forms[i].step_s < pc.forms[size_t(pc.winner)].step_s))
          pc.winner = int(i);
      cases.push_back(std::move(pc));
    }
  }
  return cases;
}

}  // namespace laga
