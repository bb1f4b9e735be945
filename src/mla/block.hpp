// The MLA block on one rank of a sequence-parallel group, in one of the
// registered forms (mla/forms.def, one form_NAME.cpp each; their data flow in
// their rows, FormSpec::flow, `laga forms` and docs/forms.md): the
// head-parallel explicit, absorbed, laga, laga_fused and laga2d, the
// context-parallel allgather_kv, ring_kv, ring_latent and the hierarchical
// a2a_p2p, with the variants their traits admit (FormVariant, form_spec.hpp).
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
#include "mla/form_spec.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"

namespace laga {

// laga2d's grid on `layout` for v.head_groups (0: the default rule).
HeadContextGrid laga2d_grid(const SpLayout& layout, FormVariant v);

struct BlockContext {
  const MlaConfig& cfg;
  const SpLayout& layout;
  Communicator& comm;
  const RopeTable& rope;             // covers positions [0, layout.seq)
  FormVariant variant = Form::laga;  // checked by check_variant at every step
  AttentionKind attention = AttentionKind::eager;
  // Packed sequences (mla/documents.hpp): attention stays inside each
  // document and RoPE positions restart at each. Null: one document per row.
  const Documents* documents = nullptr;
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
