#include "model/pipeline.hpp"

#include <map>
#include <memory>

#include "core/error.hpp"

namespace laga {

std::vector<PipelinePass> one_f_one_b_order(int stages, int stage, int micro_batches) {
  std::vector<PipelinePass> order;
  const int warm = std::min(stages - stage - 1, micro_batches);
  int f = 0, b = 0;
  for (; f < warm; ++f) order.push_back({true, f});
  for (; f < micro_batches; ++f, ++b) order.push_back({true, f}), order.push_back({false, b});
  for (; b < micro_batches; ++b) order.push_back({false, b});
  return order;
}

std::vector<std::vector<std::optional<PipelinePass>>> pipeline_ticks(int stages,
                                                                     int micro_batches) {
  LAGA_CHECK(stages >= 1 && micro_batches >= 1, "pipeline: ", stages, " stages and ", micro_batches,
             " micro-batches; need at least 1 of each");
  std::vector<std::vector<PipelinePass>> order;
  for (int s = 0; s < stages; ++s) order.push_back(one_f_one_b_order(stages, s, micro_batches));
  // done[s][forward][m]: the tick stage s ran that pass; -1 not yet.
  std::vector<std::vector<std::vector<int>>> done(
      size_t(stages),
      std::vector<std::vector<int>>(2, std::vector<int>(size_t(micro_batches), -1)));
  std::vector<size_t> next(static_cast<size_t>(stages), 0);
  std::vector<std::vector<std::optional<PipelinePass>>> ticks;
  const auto ran_before = [&](int s, bool fwd, int m, int t) {
    const int at = done[size_t(s)][fwd ? 1 : 0][size_t(m)];
    return at >= 0 && at < t;
  };
  for (int t = 0;; ++t) {
    bool left = false;
    std::vector<std::optional<PipelinePass>> tick(static_cast<size_t>(stages));
    for (int s = 0; s < stages; ++s) {
      if (next[size_t(s)] == order[size_t(s)].size()) continue;
      left = true;
      const PipelinePass p = order[size_t(s)][next[size_t(s)]];
      const bool ready = p.forward ? (s == 0 || ran_before(s - 1, true, p.micro_batch, t))
                                   : (s == stages - 1 ? ran_before(s, true, p.micro_batch, t)
                                                      : ran_before(s + 1, false, p.micro_batch, t));
      if (ready) tick[size_t(s)] = p;
    }
    if (!left) return ticks;
    for (int s = 0; s < stages; ++s)
      if (tick[size_t(s)]) {
        done[size_t(s)][tick[size_t(s)]->forward ? 1 : 0][size_t(tick[size_t(s)]->micro_batch)] = t;
        ++next[size_t(s)];
      }
    ticks.push_back(std::move(tick));
  }
}

template <class T>
double pipeline_forward_backward(Communicator& pp, const LmConfig& cfg,
                                 const std::vector<LmStage>& stages, const LmParams<T>& w,
                                 const std::int32_t* tokens, const std::int32_t* targets,
                                 std::int64_t B, std::int64_t S, int micro_batches,
                                 AttentionKind attention, LmParams<T>& grads,
                                 ExpertRouting* routing, FormVariant variant) {
  const int PP = pp.size(), r = pp.rank();
  LAGA_CHECK(int(stages.size()) == PP, "pipeline: ", stages.size(), " stages on ", PP,
             " ranks; give one stage a rank");
  LAGA_CHECK(micro_batches >= 1 && B % micro_batches == 0, "pipeline: batch ", B,
             " is not a multiple of ", micro_batches, " micro-batches");
  const std::int64_t Bm = B / micro_batches, N = Bm * S, D = cfg.dim();
  const LmStage& stage = stages[size_t(r)];
  // Within the stage: one rank, every layer's collectives on itself.
  const std::unique_ptr<Communicator> self = make_self_communicator();
  const SpLayout layout = SpLayout::even(Bm, S, cfg.mla.n_heads, 1);
  const RopeTable rope(cfg.mla.rope(), S);
  LmContext ctx{cfg, layout, *self, rope, variant, attention};
  ExpertRouting micro;  // one micro-batch's, summed into *routing
  if (routing) {
    ctx.routing = &micro;
    routing->expert.assign(size_t(cfg.layers), {});
    routing->count.assign(size_t(cfg.layers), {});
    for (std::int64_t l = 0; l < cfg.layers; ++l)
      if (cfg.is_moe_layer(l))
        routing->count[size_t(l)].assign(size_t(cfg.moe->n_routed_experts), 0);
  }
  const double scale = 1.0 / double(B * S);
  const auto ticks = pipeline_ticks(PP, micro_batches);
  std::map<int, LmStagePass<T>> passes;            // micro-batches in flight: forward to backward
  std::map<int, Tensor<T>> activations, grads_in;  // arrived from the neighbours
  double loss_sum = 0;
  T none{};
  for (const auto& tick : ticks) {
    const std::optional<PipelinePass>& mine = tick[size_t(r)];
    Tensor<T> out;  // what this stage sends this tick
    if (mine) {
      const int m = mine->micro_batch;
      const std::int32_t* tok = tokens + std::int64_t(m) * N;
      const std::int32_t* tgt = targets + std::int64_t(m) * N;
      if (mine->forward) {
        Tensor<T> x;
        if (!stage.embedding) x = std::move(activations.at(m)), activations.erase(m);
        loss_sum += lm_stage_forward(ctx, w, stage, tok, tgt, x, passes[m]);
        if (routing)
          for (std::int64_t l = stage.first; l < stage.last; ++l) {
            const std::vector<std::int64_t>& c = micro.count[size_t(l)];
            std::vector<std::int64_t>& sum = routing->count[size_t(l)];
            for (size_t e = 0; e < c.size() && e < sum.size(); ++e) sum[e] += c[e];
            const std::vector<std::int32_t>& x_e = micro.expert[size_t(l)];
            routing->expert[size_t(l)].insert(routing->expert[size_t(l)].end(), x_e.begin(),
                                              x_e.end());
          }
        if (!stage.head) out = std::move(x);
      } else {
        Tensor<T> dx;
        if (!stage.head) dx = std::move(grads_in.at(m)), grads_in.erase(m);
        lm_stage_backward(ctx, w, stage, tok, tgt, scale, dx, passes.at(m), grads);
        passes.erase(m);
        if (!stage.embedding) out = std::move(dx);
      }
    }
    // Activations forward: to r + 1 from r - 1 (the ring's wrap sends nothing).
    const auto sends = [&](int s, bool fwd) {
      return s >= 0 && s < PP && tick[size_t(s)] && tick[size_t(s)]->forward == fwd &&
             (fwd ? s < PP - 1 : s > 0);
    };
    for (const bool fwd : {true, false}) {
      pp.set_phase(fwd ? Phase::forward : Phase::backward);
      const bool send = sends(r, fwd), recv = sends(fwd ? r - 1 : r + 1, fwd);
      Tensor<T> in;
      if (recv) in = Tensor<T>({N, D});
      pp.ring_shift(send ? out.data() : &none, send ? N * D : 0, recv ? in.data() : &none,
                    recv ? N * D : 0, fwd ? "pp_activation" : "pp_gradient",
                    Ring(fwd ? RingDirection::forward : RingDirection::backward));
      if (recv) {
        const int m = tick[size_t(fwd ? r - 1 : r + 1)]->micro_batch;
        (fwd ? activations : grads_in)[m] = std::move(in);
      }
    }
  }
  pp.set_phase(Phase::grad_sync);
  pp.all_reduce(&loss_sum, 1, "loss_allreduce");
  return loss_sum / double(B * S);  // as lm_forward_backward divides
}

template double pipeline_forward_backward<float>(Communicator&, const LmConfig&,
                                                 const std::vector<LmStage>&,
                                                 const LmParams<float>&, const std::int32_t*,
                                                 const std::int32_t*, std::int64_t, std::int64_t,
                                                 int, AttentionKind, LmParams<float>&,
                                                 ExpertRouting*, FormVariant);
template double pipeline_forward_backward<double>(Communicator&, const LmConfig&,
                                                  const std::vector<LmStage>&,
                                                  const LmParams<double>&, const std::int32_t*,
                                                  const std::int32_t*, std::int64_t, std::int64_t,
                                                  int, AttentionKind, LmParams<double>&,
                                                  ExpertRouting*, FormVariant);

}  // namespace laga
