#include "plan/planner.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/form_registry.hpp"
#include "mla/params.hpp"

namespace laga {

namespace {

// One form at one (S, P): its ranks' work, computed once and re-timed per
// bandwidth for the crossover.
struct FormWork {
  FormVariant form;
  std::vector<RankWork> classes;  // per rank class
  std::vector<int> class_of;      // per rank

  std::vector<const RankWork*> ranks() const {
    std::vector<const RankWork*> r;
    for (int k : class_of) r.push_back(&classes[size_t(k)]);
    return r;
  }
};

GroupStepTime group_step(const FormWork& f, const PlanRequest& q, const Fabric& fabric) {
  return group_step_time(f.ranks(), q.profile, q.dtype, fabric);
}

Fabric at_bandwidth(Fabric f, double bytes_per_s) {
  f.intra.bytes_per_s = f.inter.bytes_per_s = bytes_per_s;
  return f;
}

Crossover find_crossover(const FormWork& laga, const FormWork& expl, const PlanRequest& q,
                         const Fabric& fabric) {
  Crossover c;
  // laga's time minus explicit's at bandwidth b: negative where laga wins.
  auto lead = [&](double b) {
    const Fabric f = at_bandwidth(fabric, b);
    return group_step(laga, q, f).step_s - group_step(expl, q, f).step_s;
  };
  const int steps = 160;  // half-decades over 1 MB/s .. 100 TB/s, 20 per decade
  const double lo = std::log10(c.scanned_low), hi = std::log10(c.scanned_high);
  double b0 = c.scanned_low, d0 = lead(b0);
  for (int i = 1; i <= steps; ++i) {
    const double b1 = std::pow(10.0, lo + (hi - lo) * i / steps), d1 = lead(b1);
    if ((d0 < 0) != (d1 < 0)) {
      // Bisect in log bandwidth.
      double a = b0, z = b1;
      for (int k = 0; k < 60; ++k) {
        const double m = std::sqrt(a * z);
        ((lead(m) < 0) == (d0 < 0) ? a : z) = m;
      }
      c.found = true;
      c.bytes_per_s = std::sqrt(a * z);
      c.laga_wins_above = d1 < 0;
      return c;
    }
    b0 = b1, d0 = d1;
  }
  c.laga_wins_throughout = d0 < 0;
  return c;
}

void check_request(const PlanRequest& q) {
  LAGA_CHECK(!q.seqs.empty() && !q.sps.empty() && !q.forms.empty(),
             "plan: need at least one --seq, one --sp and one form");
  for (std::int64_t S : q.seqs)
    for (int P : q.sps)
      LAGA_CHECK(P <= S, "--sp ", P, " is more ranks than the ", S, " tokens of --seq ", S,
                 ": every rank needs at least one token; give --sp <= ", S);
  check_grad_reduce(precision_of(q.dtype), q.grad_reduce);
}

}  // namespace

ops::OpCounts plan_calls(const PlanRequest& q) {
  check_request(q);
  ops::OpCounts all;
  for (std::int64_t S : q.seqs)
    for (int P : q.sps) {
      const SpLayout layout = SpLayout::even(q.batch, S, q.cfg.n_heads, P, q.seq_layout);
      for (FormVariant form : q.forms)
        for (int r : rank_classes(q.cfg, layout, form).representatives)
          for (const ops::OpCounts& c :
               rank_work(q.cfg, layout, form, q.attention, r, q.dtype, q.grad_reduce).ops)
            all.add(c);
    }
  return all;
}

std::vector<PlanCase> make_plans(const PlanRequest& q) {
  check_request(q);
  std::int64_t params = 0;
  for (const auto& [name, shape] : mla_param_shapes(q.cfg)) params += numel(shape);
  const std::int64_t resident =
      params * (element_bytes(q.dtype) + gradient_bytes(q.dtype, q.grad_reduce));
  std::vector<PlanCase> cases;
  for (std::int64_t S : q.seqs) {
    for (int P : q.sps) {
      if (q.progress) q.progress(cat("S ", S, ", P ", P));
      PlanCase pc;
      pc.seq = S, pc.sp = P;
      pc.links = plan_links(q.profile, P, q.nodes, q.link_bytes_per_s, q.link_latency_s);
      const SpLayout layout = SpLayout::even(q.batch, S, q.cfg.n_heads, P, q.seq_layout);
      std::vector<FormWork> work;
      for (FormVariant form : q.forms) {
        const RankClasses rc = rank_classes(q.cfg, layout, form);
        FormWork fw{form, {}, rc.class_of};
        for (int r : rc.representatives)
          fw.classes.push_back(
              rank_work(q.cfg, layout, form, q.attention, r, q.dtype, q.grad_reduce));
        FormPlan fp;
        fp.form = form;
        fp.resident_bytes = resident;
        // Every rank's FLOPs: each class's representative's, once per member.
        for (int k : rc.class_of)
          for (const ops::OpCounts& c : fw.classes[size_t(k)].ops)
            fp.flops_all_ranks += c.gemm_flops + c.attention_flops;
        for (const RankWork& w : fw.classes) {
          fp.bytes_sent_per_rank = std::max(fp.bytes_sent_per_rank, predicted_sent(w.comm));
          fp.bytes_sent_forward =
              std::max(fp.bytes_sent_forward, predicted_sent(w.comm, Phase::forward));
          fp.bytes_sent_backward =
              std::max(fp.bytes_sent_backward, predicted_sent(w.comm, Phase::backward));
          fp.peak_activation_bytes = std::max(fp.peak_activation_bytes, w.peak_activation_bytes);
          fp.after_forward_bytes = std::max(fp.after_forward_bytes, w.after_forward_bytes);
        }
        // The step: every rank's timeline together. The figures beside it
        // are those of the rank on its critical path: of the ranks that end
        // last, the one that waited least for its peers.
        const GroupStepTime t = group_step(fw, q, pc.links.fabric);
        size_t critical = 0;
        for (size_t r = 0; r < t.ranks.size(); ++r) {
          const RankStepTime &x = t.ranks[r], &c = t.ranks[critical];
          const bool last = x.end_s >= t.step_s * (1 - 1e-12);
          if (last && (c.end_s < t.step_s * (1 - 1e-12) || x.peer_wait_s < c.peer_wait_s))
            critical = r;
        }
        const RankWork& w = fw.classes[size_t(rc.class_of[critical])];
        fp.critical_rank = int(critical);
        fp.phases = rank_time(w, P, q.profile, q.dtype, pc.links.fabric);
        fp.hidden_comm_s = t.ranks[critical].hidden_comm_s;
        fp.peer_wait_s = t.ranks[critical].peer_wait_s;
        fp.core_share_s = t.ranks[critical].core_share_s;
        fp.crossing_bytes = crossing_bytes(w.comm, P, pc.links.fabric);
        const double worst = t.step_s;
        fp.step_s = worst;
        double comm = 0;
        for (const PhaseTime& p : fp.phases) comm += p.comm_s;
        // The share of the step the rank waits for its links: what overlap
        // did not hide.
        fp.comm_fraction = worst > 0 ? (comm - fp.hidden_comm_s) / worst : 0;
        fp.tokens_per_s = worst > 0 ? double(q.batch * S) / worst : 0;
        fp.fits = double(fp.peak_activation_bytes + resident) <= q.profile.device.memory_bytes;
        pc.forms.push_back(fp);
        work.push_back(std::move(fw));
      }
      for (size_t i = 0; i < pc.forms.size(); ++i)
        if (pc.forms[i].fits && (pc.winner < 0 || pc.forms[i].step_s < pc.forms[pc.winner].step_s))
          pc.winner = int(i);
      // The first variant of each (the plain one, when it is planned).
      const auto find = [&](Form f) {
        for (size_t i = 0; i < q.forms.size(); ++i)
          if (q.forms[i].form == f) return int(i);
        return -1;
      };
      const int l = find(Form::laga), e = find(reference_form());
      if (l >= 0 && e >= 0 && P > 1) {
        pc.crossover = find_crossover(work[size_t(l)], work[size_t(e)], q, pc.links.fabric);
        pc.crossover->laga = q.forms[size_t(l)];
      }
      cases.push_back(std::move(pc));
    }
  }
  return cases;
}

}  // namespace laga
