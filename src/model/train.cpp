#include "model/train.hpp"

#include <chrono>
#include <cmath>

#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "mla/runner.hpp"
#include "model/checkpoint.hpp"
#include "model/data.hpp"

namespace laga {

namespace {
TokenSource make_source(const TrainOptions& o) {
  if (o.data == "random") return TokenSource::random(o.model.vocab, o.seed);
  return TokenSource::file(o.data, o.data_dtype, o.model.vocab, o.seq, o.seed);
}
}  // namespace

void validate_train_options(const TrainOptions& o) {
  o.model.validate();
  LAGA_CHECK(o.sp >= 1, "--sp must be >= 1 (got ", o.sp, ")");
  LAGA_CHECK(o.seq >= o.sp, "--seq ", o.seq, " is shorter than --sp ", o.sp,
             ": every rank needs at least one token");
  LAGA_CHECK(o.batch >= 1, "--batch must be >= 1 (got ", o.batch, ")");
  LAGA_CHECK(o.steps >= 1, "--steps must be >= 1 (got ", o.steps, ")");
  LAGA_CHECK(o.adam.lr > 0, "--lr must be > 0 (got ", o.adam.lr, ")");
  LAGA_CHECK(o.save_every >= 0, "--save-every must be >= 0 (got ", o.save_every, ")");
  LAGA_CHECK(o.save_every == 0 || !o.checkpoint_dir.empty(),
             "--save-every needs --checkpoint DIR to write into");
  (void)make_source(o);  // data errors before any rank starts
}

void train_rank(Communicator& comm, const TrainOptions& o,
                const std::function<void(const StepRecord&)>& on_step) {
  using T = float;
  const LmConfig& cfg = o.model;
  const SpLayout layout = SpLayout::even(o.batch, o.seq, cfg.mla.n_heads, comm.size());
  const RopeTable rope(cfg.mla.rope(), o.seq);
  const LmContext ctx{cfg, layout, comm, rope, o.form, o.attention};
  const TokenSource source = make_source(o);
  const int r = comm.rank();
  const std::int64_t B = o.batch, S = o.seq;
  const std::int64_t off = layout.seq_offset[size_t(r)], L = layout.seq_count[size_t(r)];

  TrainState<T> st;
  st.params = LmParams<T>::zeros(cfg, MemCategory::parameters);
  st.m = LmParams<T>::zeros(cfg, MemCategory::parameters);
  st.v = LmParams<T>::zeros(cfg, MemCategory::parameters);
  st.seed = o.seed;
  if (o.resume.empty()) {
    init_lm_params(st.params, o.seed);
  } else {
    load_checkpoint(o.resume, cfg, st);
    LAGA_CHECK(st.seed == o.seed, "--resume: the checkpoint was trained with --seed ", st.seed,
               " but this run has --seed ", o.seed, "; pass --seed ", st.seed);
  }
  LmParams<T> grads = LmParams<T>::zeros(cfg, MemCategory::gradients);
  std::vector<Tensor<T>*> P, G, M, V;
  std::vector<bool> decays;
  st.params.for_each([&](const std::string& n, Tensor<T>& t) {
    P.push_back(&t);
    decays.push_back(lm_param_decays(n));
  });
  grads.for_each([&](const std::string&, Tensor<T>& t) { G.push_back(&t); });
  st.m.for_each([&](const std::string&, Tensor<T>& t) { M.push_back(&t); });
  st.v.for_each([&](const std::string&, Tensor<T>& t) { V.push_back(&t); });

  LrSchedule sched{o.adam.lr, o.warmup, o.steps, o.cosine, o.min_lr};
  std::vector<std::int32_t> window(size_t(B * (S + 1))), tokens(size_t(B * L)),
      targets(size_t(B * L));
  for (std::int64_t step = st.step + 1; step <= o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    source.batch(st.data_cursor, B, S, window.data());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L; ++i) {
        tokens[size_t(b * L + i)] = window[size_t(b * (S + 1) + off + i)];
        targets[size_t(b * L + i)] = window[size_t(b * (S + 1) + off + i + 1)];
      }
    const double loss = lm_forward_backward(ctx, st.params, tokens.data(), targets.data(), grads);
    LAGA_CHECK(std::isfinite(loss), "train: the loss at step ", step, " is ", loss,
               "; lower --lr or set --clip");
    double sq = 0.0;
    for (Tensor<T>* g : G) sq += sum_squares(g->data(), g->numel());
    const double norm = std::sqrt(sq);
    const double factor = clip_factor(norm, o.clip);
    if (factor < 1.0)
      for (Tensor<T>* g : G)
        for (std::int64_t i = 0; i < g->numel(); ++i) (*g)[i] *= static_cast<T>(factor);
    AdamWHyper h = o.adam;
    h.lr = sched.at(step);
    for (size_t k = 0; k < P.size(); ++k) {
      AdamWHyper hk = h;
      if (!decays[k]) hk.weight_decay = 0.0;
      adamw_step(P[k]->data(), M[k]->data(), V[k]->data(), G[k]->data(), P[k]->numel(), step, hk);
    }
    st.step = step;
    st.data_cursor += B;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (o.save_every > 0 && step % o.save_every == 0 && r == 0)
      save_checkpoint(o.checkpoint_dir, cfg, st);
    if (r == 0 && on_step) on_step(StepRecord{step, loss, norm, h.lr, double(B * S) / secs, secs});
  }
}

std::vector<StepRecord> train_local(const TrainOptions& o) {
  validate_train_options(o);
  std::vector<StepRecord> out;
  run_local_ranks(o.sp, [&](Communicator& comm) {
    train_rank(comm, o, [&](const StepRecord& s) { out.push_back(s); });
  });
  return out;
}

}  // namespace laga
