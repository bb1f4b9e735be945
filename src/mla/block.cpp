// The public block API (block.hpp): MlaSaved and BlockApi, which build the
// step (step.cpp), run the form's forward from its registry row and its
// tape's backward, and sum the gradients. The pieces the forms share are in
// pieces.cpp, laga_inputs.cpp and head_attention.cpp (docs/architecture.md,
// "Where the block lives").
#include "mla/block.hpp"

#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/form.hpp"
#include "mla/wire.hpp"

namespace laga {

template <class T>
MlaSaved<T>::MlaSaved() = default;
template <class T>
MlaSaved<T>::~MlaSaved() = default;
template <class T>
MlaSaved<T>::MlaSaved(MlaSaved&&) noexcept = default;
template <class T>
MlaSaved<T>& MlaSaved<T>::operator=(MlaSaved&&) noexcept = default;
template <class T>
void MlaSaved<T>::clear() {
  tape_.reset();
  step_.reset();
}
template class MlaSaved<float>;
template class MlaSaved<double>;

namespace detail {

template <class T>
void BlockApi<T>::forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                          Tensor<T>& out, MlaSaved<T>& saved) {
  saved.clear();
  saved.step_ = std::make_unique<Step>(ctx);
  const Step& st = *saved.step_;
  LAGA_CHECK(x.shape() == Shape({st.B, st.L, st.D}), "mla_forward: x on rank ", ctx.comm.rank(),
             " has shape ", to_string(x.shape()), " but this rank's shard needs ",
             to_string(Shape{st.B, st.L, st.D}));
  ctx.comm.set_phase(Phase::forward);
  const FormEntry& form = form_entry(ctx.variant.form);
  if constexpr (std::is_same_v<T, float>)
    saved.tape_ = form.f32(st, w, x, out);
  else
    saved.tape_ = form.f64(st, w, x, out);
}

template <class T>
void BlockApi<T>::backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                           const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx,
                           MlaParams<T>& grads) {
  LAGA_CHECK(!saved.empty(), "mla_backward: nothing saved; call mla_forward first");
  // The whole variant and the kernel: a backward of another variant would
  // read the tape of one form with the geometry of another.
  const BlockContext& ran = saved.step_->ctx;
  LAGA_CHECK(ran.variant == ctx.variant && ran.attention == ctx.attention,
             "mla_backward: forward ran ", to_string(ran.variant), " (head groups ",
             ran.variant.head_groups, ", ", to_string(ran.attention),
             ") but backward was asked for ", to_string(ctx.variant), " (head groups ",
             ctx.variant.head_groups, ", ", to_string(ctx.attention), ")");
  LAGA_CHECK(&saved.step_->ctx.comm == &ctx.comm,
             "mla_backward: called with another communicator than its forward");
  LAGA_CHECK(dout.shape() == x.shape(), "mla_backward: dout has shape ", to_string(dout.shape()),
             " but x has ", to_string(x.shape()));
  ctx.comm.set_phase(Phase::backward);
  saved.tape_->backward(*saved.step_, w, x, dout, dx, grads);
  saved.clear();
}

template <class T>
void BlockApi<T>::sync_gradients(Communicator& comm, MlaParams<T>& grads) {
  // One rank's gradients are the sum already; the all-reduce would only copy
  // every parameter's gradient twice (and stage it, in-process).
  if (comm.size() == 1) return;
  comm.set_phase(Phase::grad_sync);
  Tensor<T> flat({grads.numel()}, "grad_allreduce flat", MemCategory::comm_buffers);
  std::int64_t off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    ops::copy(ops::flat(flat).col_range(off, g.numel()), ops::flat(std::as_const(g)));
    off += g.numel();
  });
  wire::all_reduce_gradients(comm, flat.data(), flat.numel());
  off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    ops::copy(ops::flat(g), ops::flat(std::as_const(flat)).col_range(off, g.numel()));
    off += g.numel();
  });
}

template struct BlockApi<float>;
template struct BlockApi<double>;

}  // namespace detail

}  // namespace laga
