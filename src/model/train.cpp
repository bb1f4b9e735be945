// The training loop of `laga train` (model/train.hpp): train_rank, its
// step, train_local and predict_train_memory (the loop's count-only run).
// The options' checks before any rank starts: train_options.cpp.
#include "model/train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <set>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "core/nonfinite.hpp"
#include "core/threads.hpp"
#include "mla/form_spec.hpp"
#include "mla/ops.hpp"
#include "mla/ops_model.hpp"
#include "mla/runner.hpp"
#include "model/checkpoint.hpp"
#include "model/data.hpp"
#include "model/pipeline.hpp"

namespace laga {

namespace fs = std::filesystem;

namespace {

// The model's context for the options' form, attention, query exchange, head
// groups and overlap: one construction for train_rank and its count-only run
// (predict_train_memory), so the two run the same model.
// Under --dp, group is the replica's SP group and world every rank.
LmContext lm_context(const TrainOptions& o, const SpLayout& layout, Communicator& group,
                     const RopeTable& rope, Communicator* world = nullptr) {
  LmContext ctx{o.model, layout, group, rope, o.variant, o.attention};
  ctx.experts = o.experts;
  ctx.expert_degree = o.expert_degree;
  ctx.world = world;
  return ctx;
}

// A data-parallel run's replica group for this rank (sp 1: one rank alone,
// TrainOptions::dp); null without --dp.
std::unique_ptr<Communicator> replica_group(const TrainOptions& o) {
  if (o.dp <= 1) return nullptr;
  LAGA_CHECK(o.sp == 1, "--dp with --sp > 1 is not built yet");
  return make_self_communicator();
}

// What a rank keeps for the whole run, allocated in this order by train_rank
// and by its count-only run (predict_train_memory): parameters, the AdamW
// moments (zero) and the gradient accumulators.
template <class T>
struct RankTensors {
  TrainState<T> st;
  LmParams<T> grads;
  explicit RankTensors(const LmConfig& cfg) {
    st.params = LmParams<T>::zeros(cfg, MemCategory::parameters);
    st.m = LmParams<T>::zeros(cfg, MemCategory::optimizer);
    st.v = LmParams<T>::zeros(cfg, MemCategory::optimizer);
    grads = LmParams<T>::zeros(cfg, MemCategory::gradients);
  }
};

// The first gradient tensor holding a non-finite value, described, and how
// many others hold some; "" when every gradient is finite.
template <class T>
std::string first_nonfinite_gradient(const LmParams<T>& grads) {
  std::string first;
  int others = 0;
  grads.for_each([&](const std::string& name, const Tensor<T>& g) {
    const NonFinite nf = ops::count_nonfinite(g);
    if (nf.count == 0) return;
    if (first.empty())
      first = describe_nonfinite("the gradient of '" + name + "'", nf, g.numel());
    else
      ++others;
  });
  if (others > 0) first += cat(", and ", others, " more gradient tensor(s) hold some");
  return first;
}

// Whether parameter `name` (LmParams::for_each's) is one of `stage`'s: its
// layers', the embedding on the first stage, the final norm and head on the
// last.
bool stage_holds(const LmStage& stage, const std::string& name) {
  if (name.rfind("layers.", 0) == 0) {
    const std::int64_t l = std::stoll(name.substr(7));
    return l >= stage.first && l < stage.last;
  }
  if (name.rfind("embed", 0) == 0) return stage.embedding;
  return stage.head;  // norm.weight, head.weight
}

// Under --pp every rank updates its own stage's parameters and moments only
// (train_rank): before a checkpoint, each tensor's owner's values go to
// every rank (an all-reduce of the owner's values and the others' zeros,
// exact: x + 0 == x), so rank 0 writes the whole current state. The experts'
// biases move alike on every rank (the load is summed over the stages) and
// are taken from their owner too.
template <class T>
void gather_stage_state(Communicator& comm, const TrainOptions& o, TrainState<T>& st) {
  const LmStage& mine = o.stages[size_t(comm.rank())];
  comm.set_phase(Phase::grad_sync);
  for (LmParams<T>* p : {&st.params, &st.m, &st.v})
    p->for_each([&](const std::string& n, Tensor<T>& t) {
      if (!stage_holds(mine, n)) t.fill(T(0));
      comm.all_reduce(t.data(), t.numel(), "pp_state_gather");
    });
}

struct StepOutcome {
  double loss = 0, grad_norm = 0;
  std::optional<double> index_kl;         // StepRecord::index_kl
  std::vector<std::int64_t> expert_load;  // StepRecord::expert_load
};

// Step `step` on this rank: forward + backward (gradients summed over the
// group), o.after_backward, the non-finite checks, clipping by the global
// norm, AdamW at learning rate lr. A non-finite loss or gradient stops here,
// before AdamW touches a weight or a moment, on every rank alike (the loss
// and the summed gradients are the same on each); with o.allow_nonfinite it
// is reported through o.warn (rank 0) and the step goes on. Under a
// count-only pool every tensor is accounted and nothing computed (the loss
// and norm are 0), which is how predict_train_memory runs it.
template <class T>
StepOutcome take_step(const LmContext& ctx, const TrainOptions& o, std::int64_t step, double lr,
                      TrainState<T>& st, LmParams<T>& grads, const std::int32_t* tokens,
                      const std::int32_t* targets) {
  StepOutcome out;
  // The aux-loss-free balancing needs the step's routing (docs/moe.md).
  const bool balance = ctx.cfg.moe && ctx.cfg.bias_update_speed > 0;
  ExpertRouting routing;
  LmContext step_ctx = ctx;
  if (balance) step_ctx.routing = &routing;
  const bool dsa = ctx.cfg.mla.dsa();
  double index_kl = 0;  // this rank's, summed over its query rows and the layers
  if (dsa) step_ctx.index_kl = &index_kl;
  const bool piped = o.pp > 1;
  if (piped) {
    // The stage's gradients are added (model/pipeline.hpp): start from 0.
    grads.for_each([](const std::string&, Tensor<T>& g) { g.fill(T(0)); });
    out.loss = pipeline_forward_backward(ctx.comm, ctx.cfg, o.stages, st.params, tokens, targets,
                                         o.batch, o.seq, int(o.micro_batches), ctx.attention, grads,
                                         balance ? &routing : nullptr, ctx.variant);
  } else {
    out.loss = lm_forward_backward(step_ctx, st.params, tokens, targets, grads);
  }
  if (dsa) {
    if (ctx.comm.size() > 1) {
      ctx.comm.set_phase(Phase::forward);
      ctx.comm.all_reduce(&index_kl, 1, "index_kl_allreduce");
    }
    out.index_kl = index_kl / double(ctx.layout.batch * ctx.layout.seq) / double(ctx.cfg.layers);
  }
  if (o.after_backward) o.after_backward(step, st.params, grads);
  const auto nonfinite = [&](const std::string& what) {
    const std::string untouched =
        cat("; the step was not applied (the weights are those after step ", step - 1,
            ") and no checkpoint of it was written");
    LAGA_CHECK(o.allow_nonfinite, "train: ", what, untouched,
               ". Lower --lr, set --clip, or check --data; or pass --allow-nonfinite to train "
               "on anyway");
    if (ctx.everyone().rank() == 0 && o.warn) o.warn(what + " (--allow-nonfinite: applied anyway)");
  };
  if (!std::isfinite(out.loss)) nonfinite(cat("the loss at step ", step, " is ", out.loss));
  if (out.index_kl && !std::isfinite(*out.index_kl))
    nonfinite(cat("the DSA indexer's KL at step ", step, " is ", *out.index_kl));
  std::vector<Tensor<T>*> P, G, M, V;
  std::vector<bool> decays, trains;
  // The DSA indexers' gradients are their KL's, another loss: left out of
  // the LM's norm and clipping (model/dsa_layer.hpp), checked on their own.
  std::vector<bool> indexer;
  const int stage = piped ? ctx.comm.rank() : 0;
  st.params.for_each([&](const std::string& n, Tensor<T>& t) {
    P.push_back(&t);
    decays.push_back(lm_param_decays(n));
    // Under --pp a rank updates its own stage's parameters only.
    trains.push_back(lm_param_trains(n) && (!piped || stage_holds(o.stages[size_t(stage)], n)));
    indexer.push_back(lm_param_is_indexer(n));
  });
  grads.for_each([&](const std::string&, Tensor<T>& t) { G.push_back(&t); });
  st.m.for_each([&](const std::string&, Tensor<T>& t) { M.push_back(&t); });
  st.v.for_each([&](const std::string&, Tensor<T>& t) { V.push_back(&t); });
  double sq = 0.0, sq_indexer = 0.0;
  for (size_t k = 0; k < G.size(); ++k) (indexer[k] ? sq_indexer : sq) += ops::sum_squares(*G[k]);
  if (!std::isfinite(sq_indexer))
    nonfinite(cat("the DSA indexer's gradient at step ", step,
                  " is not finite: ", first_nonfinite_gradient(grads)));
  if (piped) {  // each stage's gradients, the others 0: the global norm's square is their sum
    ctx.comm.set_phase(Phase::grad_sync);
    ctx.comm.all_reduce(&sq, 1, "grad_norm_allreduce");
  }
  out.grad_norm = std::sqrt(sq);
  // The squares of finite floats sum in double without overflow, so a
  // non-finite norm means a non-finite gradient (named), and a finite loss
  // beside it an overflowing backward.
  if (!std::isfinite(out.grad_norm)) {
    std::string where = first_nonfinite_gradient(grads);
    if (piped) {
      // Only the stage's own rank sees its gradients: name the stages, the
      // same words on every rank (each says whether its own holds one).
      std::vector<double> bad(o.stages.size(), 0.0);
      bad[size_t(stage)] = where.empty() ? 0.0 : 1.0;
      ctx.comm.all_reduce(bad.data(), std::int64_t(bad.size()), "nonfinite_stages");
      where.clear();
      for (size_t s = 0; s < bad.size(); ++s)
        if (bad[s] > 0)
          where += cat(where.empty() ? "on pipeline stage " : ", stage ", s, " (layers [",
                       o.stages[s].first, ", ", o.stages[s].last, "))");
    }
    nonfinite(cat("the gradient at step ", step, " is not finite (norm ", out.grad_norm, ", loss ",
                  out.loss, ")", where.empty() ? "" : ": " + where));
  }
  const double factor = clip_factor(out.grad_norm, o.clip);
  if (factor < 1.0)
    for (size_t k = 0; k < G.size(); ++k)
      if (!indexer[k]) ops::scale(*G[k], static_cast<T>(factor));
  AdamWHyper h = o.adam;
  h.lr = lr;
  for (size_t k = 0; k < P.size(); ++k) {
    if (!trains[k]) continue;  // an expert bias: its gradient slot is 0, its moments stay 0
    AdamWHyper hk = h;
    if (!decays[k]) hk.weight_decay = 0.0;
    ops::adamw(*P[k], *M[k], *V[k], *G[k], step, hk);
  }
  // Then each MoE layer's bias by the step's load over the whole group, once
  // per optimizer step.
  if (balance) {
    const std::vector<std::vector<std::int64_t>> load =
        group_expert_load(ctx.everyone(), ctx.cfg, routing);
    for (const std::vector<std::int64_t>& layer : load)
      out.expert_load.insert(out.expert_load.end(), layer.begin(), layer.end());
    for (size_t l = 0; l < load.size(); ++l) {
      if (load[l].empty()) continue;  // a dense layer
      ops::update_on_host<T>(st.params.layers[l].moe.gate_bias, [&](std::vector<T> bias) {
        return update_expert_bias(bias, load[l], ctx.cfg.bias_update_speed);
      });
    }
  }
  return out;
}

}  // namespace

TrainEnd train_rank(Communicator& comm, const TrainOptions& o,
                    const std::function<void(const StepRecord&)>& on_step) {
  using T = float;
  // This rank's ops at the run's precision; an in-process rank thread would
  // inherit it from its starter, an MPI rank is the process that parsed it.
  const UsePrecision at_precision(o.precision, o.grad_reduce);
  // --invariant: this rank's ops in the invariant mode (docs/invariance.md).
  const ops::UseInvariant invariant(o.invariant);
  const LmConfig& cfg = o.model;
  const SpLayout layout = train_layout(o, comm.size());
  const RopeTable rope(cfg.mla.rope(), o.seq);
  const std::unique_ptr<Communicator> replica = replica_group(o);
  const LmContext ctx =
      replica ? lm_context(o, layout, *replica, rope, &comm) : lm_context(o, layout, comm, rope);
  const TokenSource source = train_token_source(o);
  const int r = comm.rank();
  // A pipeline stage holds the whole sequence; a data-parallel replica
  // (TrainOptions::dp) its rows [first_row, first_row + B_r).
  const int sp_size = o.pp > 1 ? 1 : layout.ranks;
  const int sp_rank = r % sp_size;
  const std::int64_t B = o.batch, S = o.seq, B_r = layout.batch;
  const std::int64_t first_row = o.dp > 1 ? std::int64_t(r / sp_size) * B_r : 0;
  const std::int64_t L = layout.seq_count[size_t(sp_rank)];
  // (L), SpLayout's order
  const std::vector<std::int64_t> own_positions = layout.positions(sp_rank);
  // Rank 0 writes the checkpoints; what they record is fixed for the run.
  const CheckpointOptions recorded =
      r == 0 && !o.checkpoint_dir.empty() ? recorded_options(o) : CheckpointOptions{};

  RankTensors<T> rank_tensors(cfg);
  TrainState<T>& st = rank_tensors.st;
  st.seed = o.seed;
  if (o.resume.empty()) {
    init_lm_params(st.params, o.seed);
  } else {
    // validate_train_options compared the recorded options (and seed) with o.
    std::vector<std::string> nonfinite;
    load_checkpoint(o.resume, cfg, st, o.allow_nonfinite, &nonfinite);
    if (r == 0 && o.warn)
      for (const std::string& w : nonfinite) o.warn(w + " (--allow-nonfinite: loaded anyway)");
    st.seed = o.seed;
  }

  TrainEnd end;
  end.step = st.step;
  LrSchedule sched{o.adam.lr, o.warmup, o.steps, o.cosine, o.min_lr};
  std::vector<std::int32_t> window(size_t(B * (S + 1))), tokens(size_t(B_r * L)),
      targets(size_t(B_r * L));
  // The batch of `cursor` from src into this rank's tokens and targets (B, L)
  // and its packing. Every rank draws the whole window, so each knows every
  // row's documents and the global count of targets the loss is the mean over.
  const auto load_batch = [&](const TokenSource& src, std::int64_t cursor,
                              const std::string& what) {
    src.batch(cursor, B, S, window.data());
    std::optional<PackedBatch> packed;
    if (o.pack_eos) {
      packed = pack_window(window.data(), B, S, static_cast<std::int32_t>(*o.pack_eos));
      LAGA_CHECK(packed->counted > 0, what,
                 ": every input token of the batch is the "
                 "end-of-document id ",
                 *o.pack_eos,
                 " (--pack-eos), so no target counts in the loss; check the id and the data");
    }
    for (std::int64_t b = 0; b < B_r; ++b)
      for (std::int64_t i = 0; i < L; ++i) {
        const std::int64_t t = own_positions[size_t(i)], row = first_row + b;
        tokens[size_t(b * L + i)] = window[size_t(row * (S + 1) + t)];
        targets[size_t(b * L + i)] =
            packed ? packed->targets[size_t(row * S + t)] : window[size_t(row * (S + 1) + t + 1)];
      }
    return packed;
  };
  DsaStage dsa_stage = dsa_stage_at(o, st.step + 1);  // the step's, for training and validation
  const auto context_for = [&](const std::optional<PackedBatch>& packed) {
    LmContext c = ctx;
    c.dsa_stage = dsa_stage;
    if (packed) {
      c.documents = &packed->documents;
      c.counted_targets = packed->counted;
    }
    return c;
  };
  // Validation: the mean of val_batches forward losses on fixed batches.
  const std::optional<TokenSource> val =
      o.val_data.empty() ? std::nullopt
                         : std::optional<TokenSource>(TokenSource::file(
                               o.val_data, o.data_dtype, cfg.vocab, o.seq, o.seed, "--val-data"));
  const auto validate = [&]() {
    double sum = 0;
    for (std::int64_t k = 0; k < o.val_batches; ++k) {
      const std::optional<PackedBatch> packed =
          load_batch(*val, k * B, cat("--val-data batch ", k));
      sum += lm_loss(context_for(packed), st.params, tokens.data(), targets.data());
    }
    return sum / double(o.val_batches);
  };
  for (std::int64_t step = st.step + 1; step <= o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    dsa_stage = dsa_stage_at(o, step);
    const std::optional<PackedBatch> packed =
        load_batch(source, st.data_cursor, cat("step ", step));
    const LmContext step_ctx = context_for(packed);
    const double lr = sched.at(step);
    const StepOutcome done =
        take_step(step_ctx, o, step, lr, st, rank_tensors.grads, tokens.data(), targets.data());
    st.step = step;
    st.data_cursor += B;
    end.step = step;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A signal reaches one process (MPI) or is seen by each thread at its own
    // time (local ranks), so the ranks vote: all stop after the same step.
    // SIGTERM wins over SIGINT when both arrived.
    const auto vote_stop = [&]() -> int {
      if (!o.stop_signal) return 0;
      const int mine = o.stop_signal->load();
      double votes[2] = {mine == SIGTERM ? 1.0 : 0.0, mine != 0 && mine != SIGTERM ? 1.0 : 0.0};
      comm.all_reduce(votes, 2, "train_stop_vote");
      return votes[0] > 0 ? SIGTERM : votes[1] > 0 ? SIGINT : 0;
    };
    int stop = vote_stop();
    const bool periodic = o.save_every > 0 && step % o.save_every == 0;
    const bool last = step == o.steps || stop != 0;
    const bool saves = !o.checkpoint_dir.empty() && (periodic || last);
    // After the timing: a step's tokens/s is its training alone.
    std::optional<double> val_loss;
    if (val && o.val_every > 0 && stop == 0 && (step % o.val_every == 0 || step == o.steps))
      val_loss = validate();
    // The step is reported (--log) before its checkpoint is written: a run
    // killed between the two leaves the log ahead of the checkpoint, which a
    // resume trims (cmd_train.cpp, prepare_log), never behind it, which would
    // lose the step's line for good.
    if (r == 0 && on_step)
      on_step(StepRecord{step, done.loss, done.grad_norm, lr, double(B * S) / secs, secs,
                         packed ? packed->counted : B * S, val_loss, done.expert_load,
                         done.index_kl,
                         cfg.mla.dsa() ? std::optional<DsaStage>(dsa_stage) : std::nullopt});
    if (saves && o.pp > 1) gather_stage_state(comm, o, st);
    if (saves && r == 0) end.checkpoint = save_checkpoint(o.checkpoint_dir, cfg, st, recorded);
    // A signal that arrived during a periodic save (a preemption's grace
    // period often starts then: saves are the slow part) stops the run with
    // that save, rather than one step and one more save later. Every rank
    // knows whether this step saved, so every rank votes again, and only
    // after rank 0 has written it: the others wait in a barrier first, so a
    // signal that reaches one of them (MPI: each rank is a process with its
    // own flag) while rank 0 writes is read after the save, not before it
    // (issue 54 M: their vote was cast on entering the wait).
    if (saves && !last) {
      comm.barrier("train_save_done");
      stop = vote_stop();
    }
    if (stop) {
      end.stop_signal = stop;
      break;
    }
  }
  return end;
}

std::vector<StepRecord> train_local(const TrainOptions& o) {
  validate_train_options(o);
  std::optional<CheckpointDirectoryLock> lock;  // see cmd_train's run_train
  if (!o.checkpoint_dir.empty()) lock.emplace(o.checkpoint_dir);
  (void)prepare_run(o);
  std::vector<StepRecord> out;
  run_local_ranks(o.ranks(), [&](Communicator& comm) {
    train_rank(comm, o, [&](const StepRecord& s) { out.push_back(s); });
  });
  return out;
}

std::vector<TrainMemory> predict_train_memory(const TrainOptions& o, StagingRule staging) {
  using T = float;
  const LmConfig& cfg = o.model;
  const SpLayout layout = train_layout(o, o.ranks());
  // The --data and --val-data files' ids, resident for the run, and the
  // larger file's bytes while it is read (counted beside both files' ids:
  // at most the validation ids too many, on the safe side).
  std::int64_t token_ids =
      o.data == "random" ? 0 : std::int64_t(sizeof(std::uint32_t)) * train_token_source(o).tokens();
  std::int64_t token_read =
      o.data == "random" ? 0 : static_cast<std::int64_t>(fs::file_size(o.data));
  if (!o.val_data.empty()) {
    token_ids += std::int64_t(sizeof(std::uint32_t)) *
                 TokenSource::file(o.val_data, o.data_dtype, cfg.vocab, o.seq, o.seed, "--val-data")
                     .tokens();
    token_read = std::max(token_read, static_cast<std::int64_t>(fs::file_size(o.val_data)));
  }
  // The step's hooks belong to the real run.
  TrainOptions counted = o;
  counted.after_backward = nullptr;
  counted.warn = nullptr;
  std::vector<TrainMemory> ranks;
  for (int r = 0; r < o.ranks(); ++r) {
    // The prediction is the step run on a count-only pool: which run to make
    // (the ops then decide, each for itself, that they only count).
    MemoryPool pool;
    pool.set_count_only(true);
    PoolScope scope(pool);
    // The run's precision: under bf16 the collectives' stagings are bf16
    // (mla/wire.hpp), and the count must allocate what the run does.
    const UsePrecision at_precision(o.precision, o.grad_reduce);
    const ops::UseInvariant invariant(o.invariant);  // its sums' pieces are counted too
    // The rank's OpenMP threads (run_group's), which size the bf16 flash
    // workspace (mla/block.cpp).
    const OmpThreadsScope threads(threads_per_rank(o.ranks()));
    DryRunCommunicator comm(r, o.ranks(), staging);
    const RopeTable rope = RopeTable::unbacked(cfg.mla.rope(), o.seq);
    const std::unique_ptr<Communicator> replica = replica_group(o);
    const LmContext ctx =
        replica ? lm_context(o, layout, *replica, rope, &comm) : lm_context(o, layout, comm, rope);
    RankTensors<T> rank_tensors(cfg);
    TrainMemory m;
    m.state = pool.current_total();
    // A DSA model's steps differ by stage (the dense warm-up attends every
    // causal key): one step of each stage the run has (dsa_stage_at of its
    // first and last step), the pool's peak over them, as the real run's
    // pool sees them in turn. A dense model runs one step.
    std::vector<DsaStage> stages = {dsa_stage_at(o, 1)};
    if (cfg.mla.dsa() && dsa_stage_at(o, o.steps) != stages.front())
      stages.push_back(dsa_stage_at(o, o.steps));
    for (DsaStage stage : stages) {
      LmContext at_stage = ctx;
      at_stage.dsa_stage = stage;
      take_step(at_stage, counted, 1, o.adam.lr, rank_tensors.st, rank_tensors.grads, nullptr,
                nullptr);
    }
    m.step_peak = pool.peak_total();
    m.cache = pool.cache_allowance();
    // RopeTable: cos and sin, positions x dim/2 doubles each.
    m.rope = 2 * o.seq * (cfg.mla.qk_rope_head_dim / 2) * std::int64_t(sizeof(double));
    m.token_ids = token_ids;
    m.token_read = token_read;
    const std::int64_t L = layout.seq_count[size_t(o.pp > 1 ? 0 : r % layout.ranks)];
    m.batch_ids =
        std::int64_t(sizeof(std::int32_t)) * (o.batch * (o.seq + 1) + 2 * layout.batch * L);
    if (o.pack_eos) {
      // PackedBatch: targets (B, S) int32, at most S + 1 cut points per row;
      // per layer, the block's Step: doc_start (B, S), positions (B, L_r)
      // and, with the query-latent exchange, seq_positions (B, S), int64.
      const std::int64_t i64 = sizeof(std::int64_t), BS = o.batch * o.seq;
      const std::int64_t per_layer =
          i64 * (BS + o.batch * L + (o.variant.queries == QueryExchange::latent ? BS : 0));
      m.packing = std::int64_t(sizeof(std::int32_t)) * BS + i64 * o.batch * (o.seq + 1) +
                  cfg.layers * per_layer;
    }
    // SafetensorsWriter copies every tensor it is given: parameters, m, v.
    if (r == 0 && !o.checkpoint_dir.empty())
      m.checkpoint = 3 * rank_tensors.st.params.numel() * std::int64_t(sizeof(T));
    m.peak = m.rope + m.token_ids +
             std::max(m.token_read, m.batch_ids + m.packing +
                                        std::max(m.step_peak + m.cache, m.state + m.checkpoint));
    ranks.push_back(m);
  }
  return ranks;
}

}  // namespace laga
