// The MLA block on one rank of a sequence-parallel group, in one of three
// forms (docs/forms.md):
//
//   explicit  up-project K/V for local tokens and all heads, all-to-all Q, K, V
//             seq->head, attend, all-to-all out head->seq   (Megatron-Core)
//   absorbed  all-to-all Q, all-gather [c | k_pe], fold W_UK into q, attend in
//             latent space, unfold W_UV after, all-to-all out (inference trick)
//   laga      all-to-all Q, all-gather [c | k_pe], up-project K/V locally for
//             the rank's own heads, attend as explicit, all-to-all out
//   laga2d    laga on a grid of Ph head groups x Pc context groups (P = Ph Pc,
//             any P): each rank attends its group's heads for two mirrored
//             query chunks over the keys up to its last query, so causal
//             work is balanced and no rank idles when P > H
//
// laga and laga2d with q_lora_rank > 0 may exchange the queries another way
// (QueryExchange::latent, `--q-latent`): move the normalised query latent
// q_norm(wq_a x), rq wide per token, instead of per-head Q, H dqk wide, and
// apply wq_b for the rank's own heads over its query rows (laga all-gathers
// it over the full sequence; laga2d sends each context group its rows).
//
// x and out are the rank's seq shard (B, L_r, D). Forward fills MlaSaved with
// what backward needs; backward consumes (and frees) it, writes dx (B, L_r, D)
// and ADDS this rank's partial parameter gradients into grads;
// mla_sync_gradients then sums them over the group with one all-reduce.
//
// Each form is described once (form_*.cpp) and that one description is run
// for real, counted (a count-only pool: shapes and bytes, no storage, no
// kernels) and so predicted (memory_model.hpp): docs/architecture.md.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "kernels/rope.hpp"
#include "mla/config.hpp"
#include "mla/documents.hpp"
#include "mla/exchange.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"

namespace laga {

enum class Form { explicit_form, absorbed, laga, laga2d };
const char* to_string(Form f);
Form parse_form(const std::string& s);  // "explicit" | "absorbed" | "laga" | "laga2d"
std::vector<Form> all_forms();          // in registry order (src/mla/form.cpp)

enum class AttentionKind { eager, flash };
const char* to_string(AttentionKind a);
AttentionKind parse_attention(const std::string& s);  // "eager" | "flash"

// How the queries reach the rank that owns their heads (docs/forms.md):
//   heads   q (B, L_r, H dqk) all-to-all seq->head, every form (label q_a2a)
//   latent  laga and laga2d, q_lora_rank > 0: qn = q_norm(wq_a x)
//           (B, L_r, rq) all-gathered to (B, S, rq) (label q_latent_ag;
//           laga2d with Pc > 1: sent to its context group's query rows
//           (B, Sq, rq), q_latent_a2a), then q_h = qn wq_b[own heads'
//           rows]^T locally. laga sends fewer bytes while P rq < H dqk
//           (query_latent_crossover, comm_model.hpp); laga2d while
//           rq < H_g dqk (query_exchange_cost).
enum class QueryExchange { heads, latent };
const char* to_string(QueryExchange q);
QueryExchange parse_query_exchange(const std::string& s);  // "heads" | "latent"

// Whether laga and laga2d overlap their latent collectives with compute
// (docs/forms.md, "Overlap", `--overlap on|off`). On: forward starts the
// latent all-gather before the query projection and its all-to-all and
// waits for it only at the up-projection; backward starts the latent
// gradient's reduce-scatter before the query path's backward and waits for
// it only at the latent's. The same collectives, bytes and bits either way;
// what is hidden is the collectives' link time (communicator.hpp, "Overlap").
enum class Overlap { off, on };
const char* to_string(Overlap o);
Overlap parse_overlap(const std::string& s);  // "off" | "on"
// The forms with an overlapped path (laga, laga2d); on any other, Overlap::on is an
// error naming the form.
bool form_overlaps(Form f);

// One way to run the block: a form, its query exchange and (laga2d) its head
// groups. Tools list these (`laga verify` and `laga compare` run
// laga+q-latent beside laga), and the closed forms take one. A Form alone is
// that form with per-head queries and, for laga2d, the default head groups.
struct FormVariant {
  Form form = Form::laga;
  QueryExchange queries = QueryExchange::heads;
  int head_groups = 0;  // laga2d: Ph (--head-groups); 0: HeadContextGrid::default_head_groups
  Overlap overlap = Overlap::off;  // on: laga and laga2d only (form_overlaps)
  FormVariant() = default;
  FormVariant(Form f, QueryExchange q = QueryExchange::heads,  // NOLINT: a Form is a variant
              int groups = 0)
      : form(f), queries(q), head_groups(groups) {}
  friend bool operator==(const FormVariant&, const FormVariant&) = default;
};
// Throws laga::Error naming the form when v.overlap is on for a form without
// an overlapped path (form_overlaps).
void check_overlap(FormVariant v);
std::string to_string(FormVariant v);  // "laga", "laga+q-latent" (the head groups are not named)

// Throws laga::Error when the query exchange does not apply: latent needs the
// laga or laga2d form (explicit and absorbed have no per-head up-projection of queries
// to move after the wire) and q_lora_rank > 0 (without it there is no query
// latent, only wq).
void check_query_exchange(const MlaConfig& cfg, FormVariant v);

// Throws laga::Error when head groups are asked of a form other than laga2d,
// or when they do not fit the layout (HeadContextGrid::make's rule).
void check_head_groups(const SpLayout& layout, FormVariant v);
// laga2d's grid on `layout` for v.head_groups (0: the default rule).
HeadContextGrid laga2d_grid(const SpLayout& layout, FormVariant v);
// Where each rank's attention runs under v (the all-to-alls' destination):
// every form but laga2d attends all S query rows for its SpLayout head
// shard (Placement::head_shards); laga2d its head group's heads for its
// context group's query chunks (Placement::query_chunks of laga2d_grid).
// The one description of a rank's attention rows and heads: the block's
// Step reads it, and so do the planner's rank classes (plan/time_model.hpp).
Placement attention_placement(const SpLayout& layout, FormVariant v);

struct BlockContext {
  const MlaConfig& cfg;
  const SpLayout& layout;
  Communicator& comm;
  const RopeTable& rope;  // covers positions [0, layout.seq)
  Form form = Form::laga;
  AttentionKind attention = AttentionKind::eager;
  // Packed sequences (mla/documents.hpp): attention stays inside each
  // document and RoPE positions restart at each. Null: one document per row.
  const Documents* documents = nullptr;
  QueryExchange queries = QueryExchange::heads;  // latent: laga, laga2d with q_lora_rank > 0
  int head_groups = 0;             // laga2d only: Ph (0: HeadContextGrid::default_head_groups)
  Overlap overlap = Overlap::off;  // on: laga and laga2d only (form_overlaps)
};

namespace detail {
struct Step;
template <class T>
struct Tape;
template <class T>
struct BlockApi;  // the implementation of the three functions below (block.cpp)
}  // namespace detail

// What forward saved for backward: the form's own typed tensors (its Tape,
// form_*.cpp) and the step's extents. Empty before forward and after
// backward.
template <class T>
class MlaSaved {
 public:
  MlaSaved();
  ~MlaSaved();
  MlaSaved(MlaSaved&&) noexcept;
  MlaSaved& operator=(MlaSaved&&) noexcept;
  bool empty() const { return tape_ == nullptr; }
  void clear();

 private:
  friend struct detail::BlockApi<T>;
  std::unique_ptr<detail::Step> step_;
  std::unique_ptr<detail::Tape<T>> tape_;
};

namespace detail {
template <class T>
struct BlockApi {
  static void forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                      Tensor<T>& out, MlaSaved<T>& saved);
  static void backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                       const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx,
                       MlaParams<T>& grads);
  static void sync_gradients(Communicator& comm, MlaParams<T>& grads);
};
}  // namespace detail

template <class T>
void mla_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x, Tensor<T>& out,
                 MlaSaved<T>& saved) {
  detail::BlockApi<T>::forward(ctx, w, x, out, saved);
}

template <class T>
void mla_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                  const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx, MlaParams<T>& grads) {
  detail::BlockApi<T>::backward(ctx, w, x, dout, saved, dx, grads);
}

// Sums every parameter gradient over the group: one all-reduce of all of them
// flattened, label "grad_allreduce", phase grad_sync; nothing at all (no
// call, no copy) on a group of one rank.
template <class T>
void mla_sync_gradients(Communicator& comm, MlaParams<T>& grads) {
  detail::BlockApi<T>::sync_gradients(comm, grads);
}

}  // namespace laga
