#include "mla/memory_model.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace laga {

namespace {

constexpr MemCategory kAct = MemCategory::activations;
constexpr MemCategory kComm = MemCategory::comm_buffers;

// The running sums of one rank's pool, driven by the allocation sequence
// written out below. Mirrors MemoryPool: peaks move only on allocation.
class Replay {
 public:
  void alloc(std::string name, MemCategory c, std::int64_t bytes) {
    live_.push_back({std::move(name), c, bytes});
    cur_[idx(c)] += bytes;
    peak_[idx(c)] = std::max(peak_[idx(c)], cur_[idx(c)]);
    const std::int64_t w = working();
    peak_working_ = std::max(peak_working_, w);
    if (w > stretch_.bytes || stretch_.where.empty()) {
      stretch_.bytes = w;
      stretch_.where = stage_ + ": " + live_.back().name;
      stretch_.live = live_;
    }
  }
  void free(const std::string& name) {
    // The latest tensor of that name: names are reused only after a free.
    for (auto it = live_.rbegin(); it != live_.rend(); ++it) {
      if (it->name != name) continue;
      cur_[idx(it->category)] -= it->bytes;
      live_.erase(std::next(it).base());
      return;
    }
    fail("memory model: frees '", name,
         "', which is not live; the modelled allocation sequence "
         "is out of step with itself (a bug in memory_model.cpp)");
  }
  // Frees it if it is live (Tensor::reset on an undefined tensor is a no-op).
  void free_if_live(const std::string& name) {
    for (const MemoryTerm& t : live_)
      if (t.name == name) return free(name);
  }
  void stage(std::string s) { stage_ = std::move(s); }
  // Ends the current stretch (as MemoryPool::reset_peaks does for a region)
  // and returns its peak, largest terms first.
  MemoryPeak end_stretch() {
    MemoryPeak p = std::move(stretch_);
    std::stable_sort(p.live.begin(), p.live.end(),
                     [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
    stretch_ = {};
    stretch_.bytes = working();
    return p;
  }
  std::int64_t current(MemCategory c) const { return cur_[idx(c)]; }
  std::int64_t peak(MemCategory c) const { return peak_[idx(c)]; }
  std::int64_t peak_working() const { return peak_working_; }

 private:
  static size_t idx(MemCategory c) { return c == kAct ? 0 : 1; }
  std::int64_t working() const { return cur_[0] + cur_[1]; }
  std::vector<MemoryTerm> live_;
  std::int64_t cur_[2] = {0, 0}, peak_[2] = {0, 0};
  std::int64_t peak_working_ = 0;
  MemoryPeak stretch_;
  std::string stage_;
};

// The block's allocation sequence on one rank. Each function below is the
// allocation skeleton of the function of the same name in src/mla (sizes in
// elements times e); keep them in step with the code — the tests fail when
// they are not.
class BlockModel {
 public:
  BlockModel(const MlaConfig& c, const SpLayout& lay, AttentionKind att, int r, std::int64_t e,
             StagingRule staging)
      : rank_(r), att_(att), staging_(staging), P(lay.ranks), e_(e) {
    const auto z = [](std::int64_t i) { return static_cast<size_t>(i); };
    B = lay.batch, L = lay.seq_count[z(r)], S = lay.seq, N = B * L, NS = B * S;
    D = c.dim, H = c.n_heads, Hr = lay.head_count[z(r)];
    dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dqk = dn + dr, dv = c.v_head_dim;
    C = c.kv_lora_rank, rq = c.q_lora_rank, W = C + dr, KV = dn + dv;
  }

  Replay m;

  void a(const std::string& name, std::int64_t elems) { m.alloc(name, kAct, elems * e_); }
  void c(const std::string& name, std::int64_t elems) { m.alloc(name, kComm, elems * e_); }
  void f(const std::string& name) { m.free(name); }

  // exchange.cpp. An all-to-all stages the whole send and receive sides; the
  // backends add nothing to an all-to-all or an all-gather.
  void seq_to_head(const std::string& label, std::int64_t d) {
    c(label + " send (B, L_r, H, d)", B * L * H * d);
    c(label + " recv (B, S, H_r, d)", B * S * Hr * d);
    f(label + " send (B, L_r, H, d)");
    f(label + " recv (B, S, H_r, d)");
  }
  void head_to_seq(const std::string& label, std::int64_t d) {
    c(label + " send (B, S, H_r, d)", B * S * Hr * d);
    c(label + " recv (B, L_r, H, d)", B * L * H * d);
    f(label + " send (B, S, H_r, d)");
    f(label + " recv (B, L_r, H, d)");
  }
  void gather_seq(const std::string& label) {
    if (B == 1) return;  // rank-major is already (S, W): gathered in place
    c(label + " recv (B, S, W)", B * S * W);
    f(label + " recv (B, S, W)");
  }
  void reduce_scatter_seq(const std::string& label) {
    if (B > 1) c(label + " send (B, S, W)", B * S * W);
    if (staging_ == StagingRule::mpi) {
      c(label + " mpi staging (P-1)(B, L_r, W)", (P - 1) * N * W);
      f(label + " mpi staging (P-1)(B, L_r, W)");
    }
    if (B > 1) f(label + " send (B, S, W)");
  }

  // block.cpp
  void project_q() {
    a("q (B, L_r, H*dqk)", N * H * dqk);
    if (rq > 0) {
      a("saved.qa (B, L_r, rq)", N * rq);
      a("saved.q_rstd (B, L_r)", N);
      a("saved.qn (B, L_r, rq)", N * rq);
    }
  }
  void project_latent(const std::string& c_hat) {
    a("saved.kv_a (B, L_r, C+dr)", N * W);
    a("saved.kv_rstd (B, L_r)", N);
    a(c_hat, N * C);
  }
  void gather_latent() {
    c("lat_loc (B, L_r, C+dr)", N * W);
    a("saved.lat (B, S, C+dr)", NS * W);
    gather_seq("latent_ag");
    f("lat_loc (B, L_r, C+dr)");
  }
  void attention_forward() {
    if (att_ == AttentionKind::eager)
      a("saved.attn_stats eager probs (B, H_r, S, S)", B * Hr * S * S);
    else
      a("saved.attn_stats flash lse (B, H_r, S)", B * Hr * S);
  }
  void attention_backward() {
    if (att_ == AttentionKind::eager) {
      a("eager dp scratch (S, S)", S * S);
      f("eager dp scratch (S, S)");
      f("saved.attn_stats eager probs (B, H_r, S, S)");
    } else {
      f("saved.attn_stats flash lse (B, H_r, S)");
    }
  }
  void project_out() {
    a("saved.o_loc (B, L_r, H*dv)", N * H * dv);
    head_to_seq("out_a2a", dv);
    a("out (B, L_r, D)", N * D);
  }
  void project_out_backward() {
    a("do_loc (B, L_r, H*dv)", N * H * dv);
    f("saved.o_loc (B, L_r, H*dv)");
    a("do_h (B, S, H_r, dv)", NS * Hr * dv);
    seq_to_head("out_a2a", dv);
    f("do_loc (B, L_r, H*dv)");
  }
  void project_in_backward() {
    a("dx (B, L_r, D)", N * D);
    a("dc_hat (B, L_r, C)", N * C);
    f("dc_hat (B, L_r, C)");
    f("saved.kv_rstd (B, L_r)");
    if (rq > 0) {
      a("dqn (B, L_r, rq)", N * rq);
      f("saved.qn (B, L_r, rq)");
      a("dqa (B, L_r, rq)", N * rq);
      f("saved.qa (B, L_r, rq)");
      f("saved.q_rstd (B, L_r)");
      f("dqa (B, L_r, rq)");
      f("dqn (B, L_r, rq)");
    }
    f("dq_loc (B, L_r, H*dqk)");
    f("dlat_loc (B, L_r, C+dr)");
    f("saved.kv_a (B, L_r, C+dr)");
  }
  void head_grads_alloc() {
    a("dq_h (B, S, H_r, dqk)", NS * Hr * dqk);
    a("dk_h (B, S, H_r, dqk)", NS * Hr * dqk);
    a("dv_h (B, S, H_r, dv)", NS * Hr * dv);
  }
  void drop_attention_inputs() {
    f("do_h (B, S, H_r, dv)");
    f("saved.q_h (B, S, H_r, dqk)");
    f("saved.k_h (B, S, H_r, dqk)");
    f("saved.v_h (B, S, H_r, dv)");
    m.free_if_live("saved.o_att (B, S, H_r, dv)");
  }
  void dq_to_seq() {
    a("dq_loc (B, L_r, H*dqk)", N * H * dqk);
    head_to_seq("q_a2a", dqk);
    f("dq_h (B, S, H_r, dqk)");
  }

  // form_explicit.cpp
  void explicit_forward() {
    project_q();
    project_latent("saved.c_hat (B, L_r, C)");
    a("k_loc (B, L_r, H*dqk)", N * H * dqk);
    a("v_loc (B, L_r, H*dv)", N * H * dv);
    a("kv (B, L_r, H*(dn+dv))", N * H * KV);
    f("kv (B, L_r, H*(dn+dv))");
    a("saved.q_h (B, S, H_r, dqk)", NS * Hr * dqk);
    seq_to_head("q_a2a", dqk);
    f("q (B, L_r, H*dqk)");
    a("saved.k_h (B, S, H_r, dqk)", NS * Hr * dqk);
    seq_to_head("k_a2a", dqk);
    f("k_loc (B, L_r, H*dqk)");
    a("saved.v_h (B, S, H_r, dv)", NS * Hr * dv);
    seq_to_head("v_a2a", dv);
    f("v_loc (B, L_r, H*dv)");
    a("saved.o_att (B, S, H_r, dv)", NS * Hr * dv);
    attention_forward();
    project_out();
    if (att_ == AttentionKind::eager) f("saved.o_att (B, S, H_r, dv)");
  }
  void explicit_backward() {
    project_out_backward();
    head_grads_alloc();
    attention_backward();
    drop_attention_inputs();
    dq_to_seq();
    a("dk_loc (B, L_r, H*dqk)", N * H * dqk);
    head_to_seq("k_a2a", dqk);
    f("dk_h (B, S, H_r, dqk)");
    a("dv_loc (B, L_r, H*dv)", N * H * dv);
    head_to_seq("v_a2a", dv);
    f("dv_h (B, S, H_r, dv)");
    a("dlat_loc (B, L_r, C+dr)", N * W);
    a("dkv (B, L_r, H*(dn+dv))", N * H * KV);
    f("dk_loc (B, L_r, H*dqk)");
    f("dv_loc (B, L_r, H*dv)");
    f("dkv (B, L_r, H*(dn+dv))");
    f("saved.c_hat (B, L_r, C)");
    project_in_backward();
  }

  // form_laga.cpp and form_absorbed.cpp share the front: Q to heads, latent gathered.
  void latent_front() {
    project_q();
    project_latent("c_hat (B, L_r, C)");
    a("saved.q_h (B, S, H_r, dqk)", NS * Hr * dqk);
    seq_to_head("q_a2a", dqk);
    f("q (B, L_r, H*dqk)");
    gather_latent();
    f("c_hat (B, L_r, C)");
  }
  void latent_back() {  // after dlat (B, S, W) is complete
    dq_to_seq();
    a("dlat_loc (B, L_r, C+dr)", N * W);
    reduce_scatter_seq("latent_ag");
    f("dlat (B, S, C+dr)");
    project_in_backward();
  }

  void laga_forward() {
    latent_front();
    a("saved.k_h (B, S, H_r, dqk)", NS * Hr * dqk);
    a("saved.v_h (B, S, H_r, dv)", NS * Hr * dv);
    a("kv_h (B, S, H_r*(dn+dv))", NS * Hr * KV);
    f("kv_h (B, S, H_r*(dn+dv))");
    a("saved.o_att (B, S, H_r, dv)", NS * Hr * dv);
    attention_forward();
    project_out();
    if (att_ == AttentionKind::eager) f("saved.o_att (B, S, H_r, dv)");
  }
  void laga_backward() {
    project_out_backward();
    head_grads_alloc();
    attention_backward();
    drop_attention_inputs();
    dq_to_seq();
    a("dlat (B, S, C+dr)", NS * W);
    a("dkv_h (B, S, H_r*(dn+dv))", NS * Hr * KV);
    f("dk_h (B, S, H_r, dqk)");
    f("dv_h (B, S, H_r, dv)");
    f("dkv_h (B, S, H_r*(dn+dv))");
    f("saved.lat (B, S, C+dr)");
    a("dlat_loc (B, L_r, C+dr)", N * W);
    reduce_scatter_seq("latent_ag");
    f("dlat (B, S, C+dr)");
    project_in_backward();
  }

  void absorbed_forward() {
    latent_front();
    a("saved.v_lat (B, S, C)", NS * C);
    a("saved.q_abs (B, S, H_r, C+dr)", NS * Hr * W);
    a("saved.o_att = o_lat (B, S, H_r, C)", NS * Hr * C);
    attention_forward();
    a("o_h (B, S, H_r, dv)", NS * Hr * dv);
    project_out();
    f("o_h (B, S, H_r, dv)");
  }
  void absorbed_backward() {
    project_out_backward();
    a("do_lat (B, S, H_r, C)", NS * Hr * C);
    f("do_h (B, S, H_r, dv)");
    a("dq_abs (B, S, H_r, C+dr)", NS * Hr * W);
    a("dlat (B, S, C+dr)", NS * W);
    a("dv_lat (B, S, C)", NS * C);
    attention_backward();
    f("dv_lat (B, S, C)");
    f("do_lat (B, S, H_r, C)");
    f("saved.o_att = o_lat (B, S, H_r, C)");
    f("saved.q_abs (B, S, H_r, C+dr)");
    f("saved.v_lat (B, S, C)");
    f("saved.lat (B, S, C+dr)");
    a("dq_h (B, S, H_r, dqk)", NS * Hr * dqk);
    f("dq_abs (B, S, H_r, C+dr)");
    f("saved.q_h (B, S, H_r, dqk)");
    latent_back();
  }

  // block.cpp mla_sync_gradients and the backend's all_reduce staging.
  void sync_gradients(std::int64_t n) {
    c("grad_allreduce flat (n_params)", n);
    const std::int64_t own = all_reduce_chunk(n, P, rank_);
    const std::int64_t staged = staging_ == StagingRule::in_process ? own
                                : staging_ == StagingRule::mpi      ? (P - 1) * own
                                                                    : 0;
    c("grad_allreduce staging", staged);
    f("grad_allreduce staging");
    f("grad_allreduce flat (n_params)");
  }

 private:
  int rank_;
  AttentionKind att_;
  StagingRule staging_;
  int P;
  std::int64_t e_;
  std::int64_t B, L, S, N, NS, D, H, Hr, dn, dr, dqk, dv, C, rq, W, KV;
};

}  // namespace

MemoryPrediction predict_memory(const MlaConfig& cfg, const SpLayout& layout, Form form,
                                AttentionKind attention, int rank, std::int64_t elem_bytes,
                                const MemoryModelOptions& options) {
  LAGA_CHECK(rank >= 0 && rank < layout.ranks, "predict_memory: rank ", rank,
             " is outside a layout of ", layout.ranks, " ranks");
  LAGA_CHECK(layout.heads == cfg.n_heads, "predict_memory: the layout splits ", layout.heads,
             " heads but the config has n_heads = ", cfg.n_heads);
  LAGA_CHECK(elem_bytes > 0, "predict_memory: elem_bytes must be positive, got ", elem_bytes);
  BlockModel b(cfg, layout, attention, rank, elem_bytes, options.staging);
  Replay& m = b.m;

  m.stage("forward");
  switch (form) {
    case Form::explicit_form:
      b.explicit_forward();
      break;
    case Form::laga:
      b.laga_forward();
      break;
    case Form::absorbed:
      b.absorbed_forward();
      break;
  }
  MemoryPrediction p;
  p.after_forward = m.current(kAct);
  if (options.backward) {
    m.stage("backward");
    switch (form) {
      case Form::explicit_form:
        b.explicit_backward();
        break;
      case Form::laga:
        b.laga_backward();
        break;
      case Form::absorbed:
        b.absorbed_backward();
        break;
    }
  }
  p.forward_backward = m.end_stretch();

  std::int64_t n = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg)) n += numel(shape);
  if (options.backward && options.grad_sync) {
    m.stage("grad_sync");
    b.sync_gradients(n);
    p.grad_sync = m.end_stretch();
  }
  p.peak_activations = m.peak(kAct);
  p.peak_comm_buffers = m.peak(kComm);
  p.peak_working = m.peak_working();
  p.parameters = n * elem_bytes;
  p.gradients = n * elem_bytes;
  return p;
}

}  // namespace laga
