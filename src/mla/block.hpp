// The MLA block on one rank of a sequence-parallel group, in one of three
// forms (docs/forms.md):
//
//   explicit  up-project K/V for local tokens and all heads, all-to-all Q, K, V
//             seq->head, attend, all-to-all out head->seq   (Megatron-Core)
//   absorbed  all-to-all Q, all-gather [c | k_pe], fold W_UK into q, attend in
//             latent space, unfold W_UV after, all-to-all out (inference trick)
//   laga      all-to-all Q, all-gather [c | k_pe], up-project K/V locally for
//             the rank's own heads, attend as explicit, all-to-all out
//
// x and out are the rank's seq shard (B, L_r, D). Forward fills MlaSaved with
// what backward needs; backward consumes (and frees) it, writes dx (B, L_r, D)
// and ADDS this rank's partial parameter gradients into grads;
// mla_sync_gradients then sums them over the group with one all-reduce.
#pragma once

#include <string>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "kernels/rope.hpp"
#include "mla/config.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"

namespace laga {

enum class Form { explicit_form, absorbed, laga };
const char* to_string(Form f);
Form parse_form(const std::string& s);  // "explicit" | "absorbed" | "laga"

enum class AttentionKind { eager, flash };
const char* to_string(AttentionKind a);
AttentionKind parse_attention(const std::string& s);  // "eager" | "flash"

struct BlockContext {
  const MlaConfig& cfg;
  const SpLayout& layout;
  Communicator& comm;
  const RopeTable& rope;  // covers positions [0, layout.seq)
  Form form = Form::laga;
  AttentionKind attention = AttentionKind::eager;
};

// Tensors saved by forward for backward. Which are set depends on the form
// and the attention kind; unset ones stay undefined (no bytes).
template <class T>
struct MlaSaved {
  // local (B, L_r, .)
  Tensor<T> qa, q_rstd, qn;  // rq > 0: wq_a output, its rstd, q_norm output
  Tensor<T> kv_a;            // (B, L_r, C+dr): [c | k_pe], k_pe already rotated
  Tensor<T> kv_rstd;         // (B, L_r)
  Tensor<T> c_hat;           // (B, L_r, C) explicit: normalised latent
  Tensor<T> o_loc;           // (B, L_r, H*dv) attention output after head->seq
  // head shard, full sequence (B, S, H_r, .)
  Tensor<T> q_h, k_h, v_h;  // explicit / laga attention inputs
  Tensor<T> lat;            // (B, S, C+dr) laga / absorbed: gathered [c_hat | k_pe]
  Tensor<T> v_lat;          // (B, S, C) absorbed: contiguous values c_hat
  Tensor<T> q_abs;          // (B, S, H_r, C+dr) absorbed: [q_nope W_UK | q_pe]
  Tensor<T> o_att;          // (B, S, H_r, dv or C) attention output (flash needs it)
  Tensor<T> attn_stats;     // eager: probs (B, H_r, S, S); flash: lse (B, H_r, S)

  void clear();
};

template <class T>
void mla_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x, Tensor<T>& out,
                 MlaSaved<T>& saved);

template <class T>
void mla_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                  const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx, MlaParams<T>& grads);

// Sums every parameter gradient over the group: one all-reduce of all of them
// flattened, label "grad_allreduce", phase grad_sync.
template <class T>
void mla_sync_gradients(Communicator& comm, MlaParams<T>& grads);

}  // namespace laga
