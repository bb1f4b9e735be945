#include "model/moe.hpp"

#include <algorithm>
#include <array>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/ops.hpp"
#include "mla/ops_model.hpp"
#include "mla/ops_token_sums.hpp"
#include "mla/wire.hpp"

namespace laga {

template <class T>
MoeParams<T> MoeParams<T>::zeros(const MoeConfig& cfg, std::int64_t D, MemCategory cat) {
  cfg.validate();
  LAGA_CHECK(D >= 1, "moe: the model dim must be >= 1, got ", D);
  const std::int64_t E = cfg.n_routed_experts, I = cfg.moe_intermediate_size,
                     Is = cfg.shared_intermediate_size();
  MoeParams p;
  p.gate = Tensor<T>::zeros({E, D}, cat);
  p.gate_bias = Tensor<T>::zeros({E}, cat);
  for (std::int64_t e = 0; e < E; ++e)
    p.experts.push_back({Tensor<T>::zeros({I, D}, cat), Tensor<T>::zeros({D, I}, cat),
                         Tensor<T>::zeros({I, D}, cat)});
  if (Is > 0)
    p.shared = {Tensor<T>::zeros({Is, D}, cat), Tensor<T>::zeros({D, Is}, cat),
                Tensor<T>::zeros({Is, D}, cat)};
  return p;
}

template <class T>
void MoeParams<T>::for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn,
                            bool with_bias) {
  fn("gate.weight", gate);
  if (with_bias) fn("gate.bias", gate_bias);
  for (size_t e = 0; e < experts.size(); ++e) {
    const std::string pre = "experts." + std::to_string(e) + ".";
    fn(pre + "w1.weight", experts[e].w1);
    fn(pre + "w2.weight", experts[e].w2);
    fn(pre + "w3.weight", experts[e].w3);
  }
  if (shared.w1.defined()) {
    fn("shared_experts.w1.weight", shared.w1);
    fn("shared_experts.w2.weight", shared.w2);
    fn("shared_experts.w3.weight", shared.w3);
  }
}

namespace {

// Every computation here is an op of mla/ops_model.hpp or mla/ops.hpp, so the
// same code runs under a count-only pool (the model's memory prediction,
// train.hpp): every tensor is still allocated in the order and shape of a
// real run, which does not depend on the routing (N k copies in all), so
// the pool's peak is the real one. Only the routing itself is data a
// count-only run does not have; what stands in for it is said by the two
// ops::data_dependent calls below (the gate's routing with an owner's rows,
// and its gradient), and the op layer decides which runs.

// (rows, cols) dense rows at p: the layer's callers hand it pointers.
template <class T>
ops::Mat<T> rows_at(T* p, std::int64_t rows, std::int64_t cols) {
  return {p, rows, cols, cols};
}

// The routed experts' linears (ops::RoutedLinears) for one layer pass, their
// bf16 slices of min(moe_bf16_row_slice, max_rows) rows: max_rows bounds any
// expert's rows, so a small layer holds no more than its largest possible
// call.
template <class T>
ops::RoutedLinears<T> expert_linears(std::int64_t max_rows, std::int64_t D, std::int64_t I,
                                     bool backward) {
  return ops::RoutedLinears<T>(moe_bf16_row_slice, max_rows, {{D, I}, {I, D}}, backward);
}

template <class T>
void check_shape(const Tensor<T>& t, const Shape& want, const std::string& name) {
  const bool backed = ops::usable(t);
  LAGA_CHECK(t.shape() == want && backed, "moe: ", name, " has shape ", to_string(t.shape()),
             backed ? "" : " (unbacked)", " but the config needs ", to_string(want),
             "; build the parameters with MoeParams::zeros for this config");
}

template <class T>
void check_params(const MoeConfig& cfg, const MoeParams<T>& w, std::int64_t D) {
  const std::int64_t E = cfg.n_routed_experts, I = cfg.moe_intermediate_size,
                     Is = cfg.shared_intermediate_size();
  check_shape(w.gate, {E, D}, "gate.weight");
  check_shape(w.gate_bias, {E}, "gate.bias");
  LAGA_CHECK(std::int64_t(w.experts.size()) == E, "moe: ", w.experts.size(),
             " experts' weights for n_routed_experts ", E,
             "; build the parameters with MoeParams::zeros for this config");
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string pre = "experts." + std::to_string(e) + ".";
    check_shape(w.experts[size_t(e)].w1, {I, D}, pre + "w1.weight");
    check_shape(w.experts[size_t(e)].w2, {D, I}, pre + "w2.weight");
    check_shape(w.experts[size_t(e)].w3, {I, D}, pre + "w3.weight");
  }
  if (Is > 0) {
    check_shape(w.shared.w1, {Is, D}, "shared_experts.w1.weight");
    check_shape(w.shared.w2, {D, Is}, "shared_experts.w2.weight");
    check_shape(w.shared.w3, {Is, D}, "shared_experts.w3.weight");
  } else {
    LAGA_CHECK(!w.shared.w1.defined(),
               "moe: shared expert weights given but n_shared_experts is 0");
  }
}

// xp (R, D): row p is x's row token[p] (the dispatch: copies grouped by expert).
template <class T>
Tensor<T> gather_rows(const T* x, const Dispatch& d, std::int64_t D) {
  Tensor<T> xp({d.rows(), D});
  ops::gather_rows(ops::mat(xp), rows_at(x, d.tokens, D), d.token.data());
  return xp;
}

}  // namespace

// ---------------------------------------------------- expert parallelism

const char* to_string(ExpertPlacement p) {
  return p == ExpertPlacement::folded ? "folded" : "every-rank";
}

ExpertParallel ExpertParallel::folded(Communicator& comm, std::int64_t experts,
                                      std::vector<std::int64_t> tokens_per_rank, int degree) {
  const int P = comm.size();
  LAGA_CHECK(experts >= 1, "moe: expert parallelism needs at least one routed expert");
  LAGA_CHECK(std::int64_t(tokens_per_rank.size()) == P, "moe: expert parallelism over ", P,
             " ranks was given the token counts of ", tokens_per_rank.size());
  const int G = degree == 0 ? P : degree;
  LAGA_CHECK(G >= 1 && P % G == 0, "--ep ", G, " must divide the ", P,
             " ranks of --sp (each EP group is EP consecutive ranks); give --ep a divisor of ", P);
  ExpertParallel ep;
  ep.comm = &comm;
  ep.group = G;
  ep.tokens = std::move(tokens_per_rank);
  ep.first.assign(size_t(G + 1), 0);
  for (int s = 0; s < G; ++s)
    ep.first[size_t(s + 1)] = ep.first[size_t(s)] + experts / G + (s < experts % G ? 1 : 0);
  return ep;
}

std::int64_t ExpertParallel::group_tokens(int j) const {
  std::int64_t n = 0;
  for (int i = 0; i < ranks(); ++i)
    if (same_group(i, j)) n += tokens[size_t(i)];
  return n;
}

std::int64_t ExpertParallel::expected_rows(int owner, std::int64_t top_k) const {
  const std::int64_t n = group_tokens(owner);
  const std::int64_t E = experts();
  // round(n k owned / E) in integers: (2 n k owned + E) / (2 E).
  return (2 * n * top_k * owned(owner) + E) / (2 * E);
}

MoeEpBytes moe_ep_bytes(const ExpertParallel& ep,
                        const std::vector<std::vector<std::int64_t>>& counts, int r, std::int64_t D,
                        std::int64_t elem) {
  const int P = ep.ranks();
  LAGA_CHECK(std::int64_t(counts.size()) == P, "moe_ep_bytes: ", counts.size(),
             " ranks' counts for ", P, " ranks");
  MoeEpBytes b;
  for (int j = 0; j < P; ++j) {
    if (j == r || !ep.same_group(j, r)) continue;
    for (std::int64_t e = ep.first_expert(j); e < ep.first_expert(j) + ep.owned(j); ++e)
      b.dispatch += counts[size_t(r)][size_t(e)] * D * elem;
    for (std::int64_t e = ep.first_expert(r); e < ep.first_expert(r) + ep.owned(r); ++e)
      b.combine += counts[size_t(j)][size_t(e)] * D * elem;
    b.counts += ep.owned(j) * 8;
  }
  return b;
}

namespace {

// Rows of rank r's owned experts as they arrive (source-major: every row
// from rank 0, by expert, then rank 1's ...) and as the experts run them
// (expert-major: expert e0's rows from every rank by rank, then e0 + 1's).
// recv[i * Er + e]: rows of owned expert e from rank i.
struct EpRows {
  int P = 1;
  std::int64_t Er = 0;
  std::vector<std::int64_t> recv;  // (P x Er)
  std::vector<std::int64_t> from,
      from_off;                      // (P) rows from each rank, their offsets (source-major)
  std::vector<std::int64_t> expert;  // (Er) rows of each owned expert (expert-major counts)
  // A count-only run has no routing: every count above is 0 (so nothing is
  // exchanged) and the tensors take the uniform expectation's size instead.
  std::int64_t count_only_rows = -1;

  EpRows(int P_, std::int64_t Er_, std::vector<std::int64_t> recv_,
         std::int64_t count_only_rows_ = -1)
      : P(P_), Er(Er_), count_only_rows(count_only_rows_) {
    recv = std::move(recv_);
    from.assign(size_t(P), 0);
    from_off.assign(size_t(P), 0);
    expert.assign(size_t(Er), 0);
    for (int i = 0; i < P; ++i)
      for (std::int64_t e = 0; e < Er; ++e) {
        from[size_t(i)] += recv[size_t(i * Er + e)];
        expert[size_t(e)] += recv[size_t(i * Er + e)];
      }
    for (int i = 1; i < P; ++i) from_off[size_t(i)] = from_off[size_t(i - 1)] + from[size_t(i - 1)];
  }
  std::int64_t rows() const {
    return count_only_rows >= 0 ? count_only_rows : from_off.back() + from.back();
  }

  // Copies every (rank, expert) block of rows between the two orders; src
  // and dst (rows(), D).
  template <class T>
  void reorder(const Tensor<T>& src, Tensor<T>& dst, bool to_expert_major) const {
    const ops::Mat<const T> from_rows = ops::mat(src);
    const ops::Mat<T> to_rows = ops::mat(dst);
    std::int64_t eo = 0;  // expert-major offset of (e, i)
    for (std::int64_t e = 0; e < Er; ++e)
      for (int i = 0; i < P; ++i) {
        // Rank i's rows of expert e start after its rows of experts < e.
        std::int64_t s_off = from_off[size_t(i)];
        for (std::int64_t f = 0; f < e; ++f) s_off += recv[size_t(i * Er + f)];
        const std::int64_t c = recv[size_t(i * Er + e)];
        ops::copy(to_rows.row_range(to_expert_major ? eo : s_off, c),
                  from_rows.row_range(to_expert_major ? s_off : eo, c));
        eo += c;
      }
  }
};

// The all_to_all_v of rows between the owners' order and the senders': a
// sender's rows for rank j are its permuted rows of j's experts (contiguous,
// since the permutation is expert-major); an owner's from rank i are
// rows.from[i] (source-major). to_owners: the dispatch's way.
template <class T>
void exchange_rows(const ExpertParallel& ep, const Dispatch& d, const EpRows& rows, std::int64_t D,
                   const T* send, T* recv, bool to_owners, const std::string& label) {
  const int P = ep.ranks(), r = ep.comm->rank();
  const size_t n = static_cast<size_t>(P);
  std::vector<std::int64_t> mine(n, 0), mine_off(n, 0), theirs(n), theirs_off(n);
  for (int j = 0; j < P; ++j) {
    // Rank j's rows from this one: its experts' copies, from its own group only.
    if (ep.same_group(j, r)) {
      const std::int64_t f0 = ep.first_expert(j), f1 = f0 + ep.owned(j);
      mine[size_t(j)] = (d.offset[size_t(f1)] - d.offset[size_t(f0)]) * D;
      mine_off[size_t(j)] = d.offset[size_t(f0)] * D;
    }
    theirs[size_t(j)] = rows.from[size_t(j)] * D;
    theirs_off[size_t(j)] = rows.from_off[size_t(j)] * D;
  }
  const auto& [sc, sd] = to_owners ? std::tie(mine, mine_off) : std::tie(theirs, theirs_off);
  const auto& [rc, rd] = to_owners ? std::tie(theirs, theirs_off) : std::tie(mine, mine_off);
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>())  // bf16 on the wire (mla/wire.hpp)
      return wire::all_to_all_v(*ep.comm, send, sc.data(), sd.data(), recv, rc.data(), rd.data(),
                                label);
  ep.comm->all_to_all_v(send, sc.data(), sd.data(), recv, rc.data(), rd.data(), label);
}

// How many rows of each owned expert every rank sends this one
// ("moe_counts"). count_only_rows: the stand-in routing's rows (moe_forward),
// -1 for a real routing.
EpRows exchange_counts(const ExpertParallel& ep, const Dispatch& d, std::int64_t count_only_rows) {
  Communicator& comm = *ep.comm;
  const int P = ep.ranks(), r = comm.rank();
  const std::int64_t Er = ep.owned(r);
  std::vector<double> send(d.count.begin(), d.count.end()), recv(size_t(P * Er), 0.0);
  const size_t n_ranks = static_cast<size_t>(P);
  std::vector<std::int64_t> sc(n_ranks, 0), sd(n_ranks, 0), rc(n_ranks, 0), rd(n_ranks);
  for (int j = 0; j < P; ++j) {
    if (ep.same_group(j, r)) {  // the counts go to the own group's owners only
      sc[size_t(j)] = ep.owned(j);
      sd[size_t(j)] = ep.first_expert(j);
      rc[size_t(j)] = Er;
    }
    rd[size_t(j)] = j * Er;
  }
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(),
                    DType::f64, "moe_counts");
  // The stand-in routing was sent counts that stand for nothing (zeros, or
  // a dry run's stand-ins): its rows are the stand-in's, and nothing is
  // exchanged (EpRows::count_only_rows; a choice of what to run, made once
  // in moe_forward).
  std::vector<std::int64_t> n(size_t(P * Er), 0);
  if (count_only_rows < 0)
    for (size_t i = 0; i < n.size(); ++i) n[i] = std::int64_t(recv[i]);
  return EpRows(P, Er, std::move(n), count_only_rows);
}

// The invariant mode's order of an owner's rows (docs/invariance.md, "In
// training"): within each owned expert, by global token index g = b S + s,
// so that an expert's gradient, a GEMM over its rows, sums them in one order
// at every P. The rows arrive rank after rank, each rank's in its token
// order (make_dispatch): the global order for one row of tokens, not for
// B > 1, where a rank's rows are b-major. Each copy's global index goes to
// the owner beside it ("moe_token_index", one double a row, exact); the
// owner sorts each expert's block by it. Returns the permutation (row k of
// the sorted order is expert-major row order[k]); empty outside the mode. A
// count-only run's stand-in rows keep their order.
std::vector<std::int32_t> global_token_order(const ExpertParallel& ep, const Dispatch& d,
                                             const EpRows& rows) {
  if (!ops::op_invariant) return {};
  const std::int64_t M = rows.rows(), R = d.rows();
  std::vector<double> mine(size_t(R), 0.0), theirs(size_t(M), 0.0);
  if (rows.count_only_rows < 0)
    for (std::int64_t p = 0; p < R; ++p)
      mine[size_t(p)] = double(ops::global_token_index(d.token[size_t(p)], "moe_token_index"));
  exchange_rows<double>(ep, d, rows, 1, mine.data(), theirs.data(), true, "moe_token_index");
  std::vector<std::int32_t> order(static_cast<size_t>(M));
  std::iota(order.begin(), order.end(), 0);
  if (rows.count_only_rows >= 0) return order;
  std::vector<double> key(
      static_cast<size_t>(M));  // expert-major, as EpRows::reorder lays the rows
  std::int64_t eo = 0;
  for (std::int64_t e = 0; e < rows.Er; ++e)
    for (int i = 0; i < rows.P; ++i) {
      std::int64_t s_off = rows.from_off[size_t(i)];
      for (std::int64_t f = 0; f < e; ++f) s_off += rows.recv[size_t(i * rows.Er + f)];
      for (std::int64_t j = 0; j < rows.recv[size_t(i * rows.Er + e)]; ++j)
        key[size_t(eo++)] = theirs[size_t(s_off + j)];
    }
  std::int64_t o = 0;
  for (std::int64_t e = 0; e < rows.Er; o += rows.expert[size_t(e)], ++e)
    std::stable_sort(
        order.begin() + o, order.begin() + o + rows.expert[size_t(e)],
        [&](std::int32_t a, std::int32_t b) { return key[size_t(a)] < key[size_t(b)]; });
  return order;
}

// src's rows in `order` (row k = src's row order[k]), or back (inverse).
template <class T>
Tensor<T> ordered_rows(const Tensor<T>& src, const std::vector<std::int32_t>& order, bool inverse) {
  Tensor<T> dst(src.shape());
  std::vector<std::int32_t> index = order;
  if (inverse)
    for (size_t k = 0; k < order.size(); ++k) index[size_t(order[k])] = std::int32_t(k);
  ops::gather_rows(ops::mat(dst), ops::mat(src), index.data());
  return dst;
}

// Experts [e0, e0 + count.size()) each run their SwiGLU on their rows of xr
// (rows, D), expert-major: a = w1 x, b = w3 x, h = silu(a) b (rows, I), y = w2 h.
// A count-only run's counts are the stand-in routing's zeros: no expert runs.
template <class T>
void experts_forward(const MoeParams<T>& w, ops::RoutedLinears<T>& lin, std::int64_t e0,
                     const std::vector<std::int64_t>& count, const Tensor<T>& xr, Tensor<T>& a,
                     Tensor<T>& b, Tensor<T>& h, Tensor<T>& y) {
  std::int64_t o = 0;
  for (size_t q = 0; q < count.size(); o += count[q], ++q) {
    const std::int64_t c = count[q];
    if (c == 0) continue;
    const ExpertParams<T>& p = w.experts[size_t(e0) + q];
    const auto rows = [&](auto& t) { return ops::mat(t).row_range(o, c); };
    lin.forward(rows(a), rows(xr), p.w1);
    lin.forward(rows(b), rows(xr), p.w3);
    ops::swiglu(rows(h), rows(a), rows(b));
    lin.forward(rows(y), rows(h), p.w2);
  }
}

// Their backward: dxr (rows, D) from dy, each expert's weight gradients added.
// An expert's gradient is one GEMM over its rows in their order here; in the
// invariant mode (docs/invariance.md, "In training") that is the tree of
// kernels/gemm_invariant.hpp over the expert's rows in global token order,
// the same at every P, because the mode runs the experts folded over every
// rank (EP = P, one owner per expert), whose rows global_token_order sorts.
template <class T>
void experts_backward(const MoeParams<T>& w, MoeParams<T>& g, ops::RoutedLinears<T>& lin,
                      std::int64_t e0, const std::vector<std::int64_t>& count, const Tensor<T>& xr,
                      const Tensor<T>& a, const Tensor<T>& b, const Tensor<T>& h,
                      const Tensor<T>& dy, Tensor<T>& dh, Tensor<T>& da, Tensor<T>& db,
                      Tensor<T>& dxr) {
  std::int64_t o = 0;
  for (size_t q = 0; q < count.size(); o += count[q], ++q) {
    const std::int64_t c = count[q];
    if (c == 0) continue;
    const ExpertParams<T>& p = w.experts[size_t(e0) + q];
    ExpertParams<T>& gp = g.experts[size_t(e0) + q];
    const auto rows = [&](auto& t) { return ops::mat(t).row_range(o, c); };
    lin.backward(rows(dh), false, gp.w2, rows(dy), rows(h), p.w2);
    ops::swiglu_backward(rows(da), rows(db), rows(dh), rows(a), rows(b));
    lin.backward(rows(dxr), false, gp.w1, rows(da), rows(xr), p.w1);
    lin.backward(rows(dxr), true, gp.w3, rows(db), rows(xr), p.w3);
  }
}

void check_ep(const ExpertParallel* ep, std::int64_t E, std::int64_t N) {
  if (!ep) return;
  LAGA_CHECK(ep->comm && ep->ranks() == ep->comm->size() && ep->group >= 1 &&
                 ep->ranks() % ep->group == 0 && ep->first.size() == size_t(ep->group) + 1 &&
                 ep->experts() == E && ep->tokens[size_t(ep->comm->rank())] == N,
             "moe: the expert-parallel placement is not this group's (", ep->ranks(), " ranks, ",
             ep->experts(), " experts) for ", E,
             " experts on this rank's tokens; make it with ExpertParallel::folded");
}

}  // namespace

template <class T>
MoeForward<T> moe_forward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x, std::int64_t N,
                          std::int64_t D, const ExpertParallel* ep) {
  cfg.validate();
  check_params(cfg, w, D);
  const std::int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                     I = cfg.moe_intermediate_size, Is = cfg.shared_intermediate_size();
  check_ep(ep, E, N);
  LAGA_CHECK(ops::usable(x, N * D), "moe: x is null");
  const ops::Mat<const T> xm = rows_at(x, N, D);
  MoeForward<T> f;
  MoeSaved<T>& s = f.saved;
  // The gate: z = x W_g^T (N, E), then the selection and weights.
  {
    Tensor<T> logits({N, E});
    ops::linear(ops::mat(logits), xm, w.gate);
    // A count-only run has no logits to route: it stands in a routing with
    // no selection, of the real one's sizes, every count 0 (so nothing is
    // exchanged and no expert runs, and every tensor sized by N k is), and,
    // with expert parallelism, an owner's rows at the uniform expectation
    // (ExpertParallel::expected_rows).
    std::tie(s.routing, s.dispatch, s.count_only_rows) = ops::data_dependent(
        [&] {
          Routing<T> r = route(cfg, logits.data(), w.gate_bias.data(), N);
          Dispatch d = make_dispatch(r);
          return std::tuple(std::move(r), std::move(d), std::int64_t(-1));
        },
        [&] {
          std::tuple<Routing<T>, Dispatch, std::int64_t> none;
          auto& [r, d, rows] = none;
          r.tokens = d.tokens = N;
          r.top_k = d.top_k = k;
          r.experts = d.experts = E;
          d.count.assign(size_t(E), 0);
          d.offset.assign(size_t(E + 1), 0);
          rows = ep ? ep->expected_rows(ep->comm->rank(), k) : -1;
          return none;
        });
  }
  const Dispatch& d = s.dispatch;
  const std::int64_t R = d.rows();  // N k routed copies
  // Each expert's SwiGLU on its rows [o, o + c) of the permuted order.
  Tensor<T> xp = gather_rows(x, d, D);
  if (!ep) {
    s.a = Tensor<T>({R, I});
    s.b = Tensor<T>({R, I});
    s.h = Tensor<T>({R, I});
    s.y = Tensor<T>({R, D});
    {
      ops::RoutedLinears<T> lin = expert_linears<T>(N, D, I, false);
      experts_forward(w, lin, 0, d.count, xp, s.a, s.b, s.h, s.y);
    }
    xp.reset();
  } else {
    // The copies to their experts' owners, the owned experts on every
    // rank's copies, the outputs back.
    Communicator& comm = *ep->comm;
    comm.set_phase(Phase::forward);
    const std::int64_t e0 = ep->first_expert(comm.rank());
    const EpRows rows = exchange_counts(*ep, d, s.count_only_rows);
    s.recv = rows.recv;
    const std::int64_t M = rows.rows();
    Tensor<T> xs({M, D});  // source-major
    exchange_rows(*ep, d, rows, D, xp.data(), xs.data(), true, "moe_dispatch");
    xp.reset();
    s.xe = Tensor<T>({M, D});
    rows.reorder(xs, s.xe, true);
    xs.reset();
    s.order = global_token_order(*ep, d, rows);  // the invariant mode's order
    if (!s.order.empty()) s.xe = ordered_rows(s.xe, s.order, false);
    s.a = Tensor<T>({M, I});
    s.b = Tensor<T>({M, I});
    s.h = Tensor<T>({M, I});
    Tensor<T> ye({M, D});
    {
      ops::RoutedLinears<T> lin = expert_linears<T>(ep->group_tokens(comm.rank()), D, I, false);
      experts_forward(w, lin, e0, rows.expert, s.xe, s.a, s.b, s.h, ye);
    }
    if (!s.order.empty()) ye = ordered_rows(ye, s.order, true);
    Tensor<T> ys({M, D});
    rows.reorder(ye, ys, false);
    ye.reset();
    s.y = Tensor<T>({R, D});
    exchange_rows(*ep, d, rows, D, ys.data(), s.y.data(), false, "moe_combine");
  }
  // The shared expert writes out; the combine adds the routed copies to it.
  f.out = Tensor<T>::zeros({N, D});
  if (Is > 0) {
    s.sa = Tensor<T>({N, Is});
    s.sb = Tensor<T>({N, Is});
    s.sh = Tensor<T>({N, Is});
    ops::linear(ops::mat(s.sa), xm, w.shared.w1);
    ops::linear(ops::mat(s.sb), xm, w.shared.w3);
    ops::swiglu(ops::mat(s.sh), ops::mat(s.sa), ops::mat(s.sb));
    ops::linear(ops::mat(f.out), ops::mat(s.sh), w.shared.w2);
  }
  // Combine: out_t += sum_j w_tj y_row(t, j), slots in order.
  ops::combine_rows(ops::mat(f.out), ops::mat(s.y), d.row.data(), s.routing.weight.data(), k);
  return f;
}

template <class T>
Tensor<T> moe_backward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x,
                       const MoeSaved<T>& s, const T* dout, MoeParams<T>& g,
                       const ExpertParallel* ep) {
  cfg.validate();
  const Dispatch& d = s.dispatch;
  const std::int64_t N = d.tokens, D = w.gate.dim(1);
  check_params(cfg, w, D);
  check_params(cfg, g, D);
  const std::int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                     I = cfg.moe_intermediate_size, Is = cfg.shared_intermediate_size();
  check_ep(ep, E, N);
  const std::int64_t R = d.rows();
  const ops::Mat<const T> xm = rows_at(x, N, D), doutm = rows_at(dout, N, D);
  Tensor<T> dx = Tensor<T>::zeros({N, D});
  ops::Mat<T> dxm = ops::mat(dx);
  // Shared expert: out += w2 h, h = silu(a) b, a = w1 x, b = w3 x.
  if (Is > 0) {
    Tensor<T> dh({N, Is}), da({N, Is}), db({N, Is});
    ops::Mat<T> dhm = ops::mat(dh);
    ops::linear_backward_over_tokens<T>(&dhm, false, g.shared.w2, doutm, ops::mat(s.sh),
                                        w.shared.w2, "moe_shared_w2_grad");
    ops::swiglu_backward(ops::mat(da), ops::mat(db), ops::mat(dh), ops::mat(s.sa), ops::mat(s.sb));
    ops::linear_backward_over_tokens<T>(&dxm, true, g.shared.w1, ops::mat(da), xm, w.shared.w1,
                                        "moe_shared_w1_grad");
    ops::linear_backward_over_tokens<T>(&dxm, true, g.shared.w3, ops::mat(db), xm, w.shared.w3,
                                        "moe_shared_w3_grad");
  }
  // Combine: out_t += sum_j w_tj y_p, p = row(t, j):
  //   dw_tj = <dout_t, y_p>,  dy_p = w_tj dout_t.
  std::vector<T> dweight(size_t(N * k));
  Tensor<T> dy({R, D});
  ops::combine_rows_backward(ops::mat(dy), dweight.data(), doutm, ops::mat(s.y), d.row.data(),
                             s.routing.weight.data(), k);
  // Each expert's SwiGLU backward on its rows; dxp (R, D) in permuted order.
  Tensor<T> dxp;
  if (!ep) {
    Tensor<T> xp = gather_rows(x, d, D);
    dxp = Tensor<T>({R, D});
    {
      Tensor<T> dh({R, I}), da({R, I}), db({R, I});
      ops::RoutedLinears<T> lin = expert_linears<T>(N, D, I, true);
      experts_backward(w, g, lin, 0, d.count, xp, s.a, s.b, s.h, dy, dh, da, db, dxp);
    }
    xp.reset();
    dy.reset();
  } else {
    // dy to the owners (the combine's adjoint), their experts' backward on
    // the rows they ran, dx of each row home (the dispatch's adjoint).
    Communicator& comm = *ep->comm;
    comm.set_phase(Phase::backward);
    const std::int64_t e0 = ep->first_expert(comm.rank());
    // The forward's rows (a count-only run's stand-in, exchange_counts).
    const EpRows rows(ep->ranks(), ep->owned(comm.rank()), s.recv, s.count_only_rows);
    const std::int64_t M = rows.rows();
    Tensor<T> dys({M, D});
    exchange_rows(*ep, d, rows, D, dy.data(), dys.data(), true, "dmoe_combine");
    dy.reset();
    Tensor<T> dye({M, D});
    rows.reorder(dys, dye, true);
    dys.reset();
    if (!s.order.empty()) dye = ordered_rows(dye, s.order, false);
    Tensor<T> dxe({M, D});
    {
      Tensor<T> dh({M, I}), da({M, I}), db({M, I});
      ops::RoutedLinears<T> lin = expert_linears<T>(ep->group_tokens(comm.rank()), D, I, true);
      experts_backward(w, g, lin, e0, rows.expert, s.xe, s.a, s.b, s.h, dye, dh, da, db, dxe);
    }
    dye.reset();
    if (!s.order.empty()) dxe = ordered_rows(dxe, s.order, true);
    Tensor<T> dxs({M, D});
    rows.reorder(dxe, dxs, false);
    dxe.reset();
    dxp = Tensor<T>({R, D});
    exchange_rows(*ep, d, rows, D, dxs.data(), dxp.data(), false, "dmoe_dispatch");
  }
  // The permutation reversed: each token's k copies added back, slots in order.
  ops::combine_rows<T>(dxm, ops::mat(dxp), d.row.data(), nullptr, k);
  dxp.reset();
  // The gate: dz from the weights (the selection is locally constant), then
  // z = x W_g^T. The stand-in routing (count-only) selected nothing, so it
  // has nothing to differentiate: no dz (the GEMM still allocates what it
  // does in a real run).
  const std::vector<T> dlogits =
      ops::data_dependent([&] { return route_backward(cfg, s.routing, dweight.data()); },
                          [] { return std::vector<T>(); });
  ops::linear_backward_over_tokens<T>(&dxm, true, g.gate, rows_at(dlogits.data(), N, E), xm, w.gate,
                                      "moe_gate_grad");
  return dx;
}

namespace {

// The tensors of s held at 2 bytes (moe.hpp, keep_narrowed says why each):
// one list, which narrowing and widening both read.
template <class T>
std::array<Tensor<T>*, 8> held_narrowed(MoeSaved<T>& s) {
  return {&s.a, &s.b, &s.h, &s.y, &s.sa, &s.sb, &s.sh, &s.xe};
}

}  // namespace

template <class T>
void keep_narrowed(MoeSaved<T>& s) {
  for (Tensor<T>* t : held_narrowed(s)) ops::keep_narrowed(*t);
}

template <class T>
void widen_kept(MoeSaved<T>& s) {
  for (Tensor<T>* t : held_narrowed(s)) ops::widen_kept(*t);
}

#define LAGA_INSTANTIATE(T)                                                                 \
  template void keep_narrowed<T>(MoeSaved<T>&);                                             \
  template void widen_kept<T>(MoeSaved<T>&);                                                \
  template struct MoeParams<T>;                                                             \
  template MoeForward<T> moe_forward<T>(const MoeConfig&, const MoeParams<T>&, const T*,    \
                                        std::int64_t, std::int64_t, const ExpertParallel*); \
  template Tensor<T> moe_backward<T>(const MoeConfig&, const MoeParams<T>&, const T*,       \
                                     const MoeSaved<T>&, const T*, MoeParams<T>&,           \
                                     const ExpertParallel*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
