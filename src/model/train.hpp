// The training loop of `laga train`, one call per rank of the SP group.
//
// Step s (1-based) of `steps`: draw the batch for data cursor (s-1) B, run
// forward + backward on the rank's seq shard (model.hpp: gradients summed
// over the group), clip by the global norm, lr from the schedule, AdamW on
// every (replicated) parameter but the MoE layers' expert biases, which then
// move by the aux-loss-free balancing rule when the model's
// bias_update_speed is above 0 (the step's expert load summed over the
// group; docs/moe.md, "In the model"). Every rank holds the same parameters and
// optimizer state after every step, so any rank can write a checkpoint and
// all of them read it on resume. All reductions run in a fixed order, so
// the same seed and P give bit-identical losses on every run and on both
// backends.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/precision.hpp"
#include "mla/block.hpp"
#include "mla/ops_model.hpp"  // AdamWHyper
#include "model/checkpoint.hpp"
#include "model/data.hpp"
#include "model/model.hpp"

namespace laga {

struct TrainOptions {
  LmConfig model;
  FormVariant variant = Form::laga;  // the blocks' (--form, --q-latent, --head-groups, --overlap)
  AttentionKind attention = AttentionKind::eager;
  // --dtype: fp32, or bf16 mixed precision (core/precision.hpp; flash
  // attention only): every GEMM and attention operand rounded to bf16 and
  // summed in fp32, while the weights, their gradients and AdamW's moments
  // stay fp32 (the master copy; docs/performance.md, "bf16 mixed precision").
  Precision precision = Precision::fp32;
  // --grad-reduce: the gradient all-reduce's wire under bf16 (mla/wire.hpp).
  GradReduce grad_reduce = GradReduce::fp32;
  // --invariant (docs/invariance.md, "In training"): every rank runs under
  // ops::UseInvariant, so the losses and the weights after every step are
  // the same bits at every --sp (and --comm): every GEMM the invariant one,
  // every sum over tokens (weight, norm and embedding gradients, the loss)
  // canonical. For the forms that offer it (FormTraits::invariant);
  // validate_train_options refuses what it does not cover, naming it.
  bool invariant = false;
  // --expert-parallel: the MoE layers' experts folded onto the sp ranks
  // (model/moe.hpp, docs/moe.md "Expert parallelism"); needs an MoE model.
  ExpertPlacement experts = ExpertPlacement::every_rank;
  // --ep N: the EP degree, groups of N consecutive sp ranks, each holding
  // every expert (N divides sp); 0: all sp ranks in one group (EP = sp).
  int expert_degree = 0;
  int sp = 1;
  // --pp N (model/pipeline.hpp; docs/planning.md, "Pipeline stages, ..."):
  // the ranks are N pipeline stages, rank s running stages[s]'s layers on
  // each of micro_batches micro-batches of batch / micro_batches rows in 1F1B
  // order, the activations and their gradients passed over the Communicator.
  // stages is the plan's placement (plan/pipeline.hpp: lm_stages of
  // pipeline_stages; the tool fills it). Within a stage one rank (sp 1, no
  // expert parallelism). Every rank holds every parameter and its AdamW
  // moments, but updates only its own stage's (the gradient norm and the
  // expert load summed over the stages); the others are made current from
  // their owners before a checkpoint is written (gather_stage_state).
  int pp = 1;
  std::int64_t micro_batches = 1;
  std::vector<LmStage> stages;
  // --dp D (docs/planning.md, "EP over the data-parallel replicas against a
  // measured step"): D data-parallel replicas, replica d the ranks [d sp,
  // (d + 1) sp) and the rows [d B/D, (d + 1) B/D) of every batch (D divides
  // batch). Each replica's attention runs on its own SP group (sp 1 today:
  // a one-rank communicator); the loss is the mean over every replica's
  // targets, the dense gradients are all-reduced over every rank, and with
  // --expert-parallel the EP groups (--ep N consecutive ranks, default all)
  // span the replicas (LmContext::world). Every rank holds the same
  // parameters after a step, so checkpoints are written and resumed as
  // without it, and dp is free to change on resume.
  int dp = 1;
  int ranks() const { return sp * pp * dp; }
  // --seq-layout: how each window's tokens are sharded over the sp ranks
  // (SpLayout, docs/forms.md "The zigzag layout"). Free to change on resume:
  // it moves which rank computes a token, not what is computed.
  SeqLayout seq_layout = SeqLayout::contiguous;
  std::int64_t batch = 1, seq = 64;
  std::int64_t steps = 10;  // total: a resumed run continues up to this step
  std::uint64_t seed = 0;
  AdamWHyper adam;  // adam.lr is the peak learning rate
  std::int64_t warmup = 0;
  bool cosine = false;
  double min_lr = 0.0;
  double clip = 0.0;  // max global grad norm; 0: no clipping
  std::string data = "random", data_dtype = "auto";
  // Validation (--val-data FILE, --val-every N, --val-batches K): every N
  // steps and after the last, the mean loss over K fixed batches of B
  // windows of the file (the seeded windows of cursors 0 .. K*B - 1, the
  // same each time; packed like training under pack_eos), forward only. It
  // reads the weights and changes nothing, so it is free to change on resume.
  std::string val_data;
  std::int64_t val_every = 0, val_batches = 4;
  // Packed documents (--pack-eos ID, model/data.hpp): the token stream is a
  // concatenation of documents each ending with this id; every window is cut
  // into its documents (attention and RoPE positions stay inside each), and
  // the target after an end-of-document token is left out of the loss and of
  // its token count. Unset: one document per row.
  std::optional<std::int64_t> pack_eos;
  // --index-warmup N, DSA models only (model/dsa_layer.hpp): steps 1..N run
  // DsaStage::dense_warmup (dense attention, the indexer's KL over every
  // causal key), the later ones DsaStage::sparse.
  std::int64_t index_warmup = 0;
  // Checkpoints go to checkpoint_dir every save_every steps, after the last
  // step, and when stopped by a signal. A fresh run refuses a directory that
  // already holds checkpoints; a resumed run may write only into the
  // directory it resumes from (docs/reliability.md, "Checkpoints").
  std::int64_t save_every = 0;
  std::string checkpoint_dir, resume;
  // Options (CheckpointOptions names: "lr", "seq", ...) a resume may change
  // from the checkpoint's values; any other change is refused.
  std::vector<std::string> allow_change;
  // When set, every rank agrees after each step whether it is non-zero (a
  // signal number: the CLI's SIGINT/SIGTERM handler stores it); if so the run
  // writes its checkpoint (when checkpoint_dir is set) and ends.
  const std::atomic<int>* stop_signal = nullptr;
  // Non-finite values (docs/reliability.md, "Non-finite values"): a resumed
  // checkpoint whose parameters or AdamW moments hold NaN or inf is refused at
  // load, and a step whose loss or gradient is not finite stops the run
  // before its AdamW update (so neither the weights nor a checkpoint see it),
  // each naming the tensor and the count. allow_nonfinite turns each refusal
  // into a line passed to `warn` (on rank 0), and the run goes on.
  bool allow_nonfinite = false;
  std::function<void(const std::string&)> warn;
  // When set, called on every rank at each step once the gradients are summed
  // over the group (under --pp: this rank's stage's, the others zero), before they are checked,
  // clipped and applied: to inspect or alter them (freezing a tensor, adding noise; the tests
  // poison one).
  std::function<void(std::int64_t step, const LmParams<float>& params, LmParams<float>& grads)>
      after_backward;
};

// The run's SpLayout over `ranks` (o.sp, or an MPI world's size): B x S
// tokens, the model's heads, sharded as o.seq_layout says.
SpLayout train_layout(const TrainOptions& o, int ranks);

// The DSA stage step `step` runs (o.index_warmup).
DsaStage dsa_stage_at(const TrainOptions& o, std::int64_t step);

// The run's tokens (--data, or random from the seed): the one source
// validate_train_options opens (data errors before any rank starts), the
// loop and predict_train_memory read.
TokenSource train_token_source(const TrainOptions& o);

// How train_rank ended.
struct TrainEnd {
  std::int64_t step = 0;   // the last step completed
  int stop_signal = 0;     // non-zero: stopped early by this signal
  std::string checkpoint;  // the last manifest written (rank 0), or ""
};

struct StepRecord {
  std::int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0, tokens_per_s = 0, seconds = 0;
  std::int64_t targets = 0;        // the targets the loss is the mean over (B*S unless packed)
  std::optional<double> val_loss;  // this step's validation (val_every), after its update
  // The step's expert load over the whole group, every MoE layer's
  // n_routed_experts counts in layer order (what the bias update all-reduces;
  // empty without bias balancing). Two runs whose loads differ routed some
  // token differently (`laga train --log-expert-load`, docs/convergence.md).
  std::vector<std::int64_t> expert_load;
  // DSA models: the step's indexer KL, the mean over query rows and layers
  // (model/dsa_layer.hpp), and the stage it ran.
  std::optional<double> index_kl;
  std::optional<DsaStage> dsa_stage;
};

// Runs the loop on this rank. on_step is called on rank 0 after each step
// (and after its checkpoint, if one is due). Throws laga::Error on bad
// options, data or checkpoints. Call validate_train_options (and, on the one
// process that writes, prepare_run) first.
TrainEnd train_rank(Communicator& comm, const TrainOptions& o,
                    const std::function<void(const StepRecord&)>& on_step);

// The options' own checks (shapes, data file, P vs seq), and for a resume
// the checkpoint's: its manifest intact, --steps above its step, every
// recorded option unchanged unless named in allow_change, and the checkpoint
// directory policy. Made before any rank starts so errors come once and
// clearly; reads files, writes none. checkpoint_writer: this process is the
// one that takes the checkpoint directory's lock and writes there (MPI: world
// rank 0); only it judges whether another run holds the lock, since the
// others may find its own lock already taken.
void validate_train_options(const TrainOptions& o, bool checkpoint_writer = true);

// The side effects a valid run needs before it starts, done by the one
// writing process: a resume from step N into a checkpoint directory holding
// later checkpoints moves those aside (set_aside_checkpoints_after). Returns
// notes for the user (what was moved; options that changed without changing
// the math: form, attention, sp).
std::vector<std::string> prepare_run(const TrainOptions& o);

// What a checkpoint records of o: every option that shapes the trajectory
// (enforced on resume) plus form, attention, sp and the data path (recorded,
// free to change). `data_identity`: "random" or the file's size and hash.
CheckpointOptions recorded_options(const TrainOptions& o);

// P in-process ranks; returns rank 0's records (tests, examples).
std::vector<StepRecord> train_local(const TrainOptions& o);

// What one rank of a training run holds at its peak, predicted from the
// options without allocating any of it (`laga train`'s upfront memory check,
// docs/reliability.md "Memory"). What the rank's MemoryPool sees is the
// count-only run of train_rank's own code: its tensors allocated as it
// allocates them and one step (forward + backward of the model, the gradient
// all-reduce, the checks, clipping and AdamW) on a count-only pool and a
// DryRunCommunicator staging as `staging` (in_process for --comm local, mpi
// under MPI), so state and step_peak are exact, not restated. The buffers it
// keeps outside the pool are counted in closed form from their sizes.
struct TrainMemory {
  std::int64_t state = 0;      // parameters, AdamW m and v, gradients (pool)
  std::int64_t step_peak = 0;  // the pool's peak over a step: state + activations + staging
  // What the pool may hold beyond step_peak in any number of steps: page
  // rounding and its block cache's kept blocks (MemoryPool::held_bound).
  std::int64_t cache = 0;
  // Outside the pool:
  std::int64_t rope = 0;        // the RoPE table: cos and sin, seq x dr/2 doubles each
  std::int64_t token_ids = 0;   // a --data file's ids as uint32 (0 for random data)
  std::int64_t token_read = 0;  // the file's bytes, held while it is read (before the model)
  std::int64_t batch_ids = 0;   // the step's window (B, S+1), tokens and targets (B, L_r): int32
  // --pack-eos: the batch's documents and whole-row targets (B, S), and what
  // every layer's block keeps of them (each token's document start (B, S),
  // positions (B, L_r), with --q-latent (B, S) too). Bounded for the most
  // documents a row can hold (S), since the count depends on the data.
  std::int64_t packing = 0;
  std::int64_t checkpoint = 0;  // a save's copy of parameters, m and v (rank 0, --checkpoint)
  // The largest sum live at once: while the token file is read (nothing of
  // the model exists yet), or during training:
  //   rope + token_ids + max(token_read,
  //                          batch_ids + packing + max(step_peak + cache, state + checkpoint))
  std::int64_t peak = 0;
};
// One per rank of o.sp. Reads (and so validates) a --data file, as
// validate_train_options does, to know its token count.
std::vector<TrainMemory> predict_train_memory(const TrainOptions& o, StagingRule staging);

// The most routed experts per MoE layer laga train takes: each expert is
// three tensors of its own (and their gradients and AdamW moments), looped
// over by the step and by the memory check, so 10^6 of them cost the check
// alone gigabytes and seconds (issue 54). DeepSeek-V3 has 256; the largest
// published top-k routers about 2048.
inline constexpr std::int64_t kMaxRoutedExperts = 16384;

}  // namespace laga
