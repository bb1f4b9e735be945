// An independent naive implementation of the whole MLA block, forward AND
// backward, in double, written from docs/mla-math.md with plain loops: no
// laga kernel, no form, no RoPE table, no GEMM. It reads only the config's
// fields; the RoPE/YaRN frequencies, the softmax scale, RMSNorm and every
// gradient are computed here, token by token and head by head.
//
// It is what the bench's block rows count #wrong against (bench_block.cpp), so
// a bug that every form shares — in a shared helper, a kernel, the config's
// softmax_scale — shows up there, which comparing the forms with each other or
// with the explicit form in double cannot. tests/mla/test_naive_mla.cpp checks
// it against PyTorch autograd (python/torch_reference.py) and against central
// finite differences, so it is not trusted on its own word either.
//
// Layout: x, dout, out, dx are (B, S, D) row-major; token s is at global
// position s; the mask is causal. Parameters and gradients are keyed by
// DeepSeek's names ("wq.weight", ...), [out, in] row-major, y = W x.
//
// Kimi K3's gated NoPE MLA (docs/mla-math.md, "Gated NoPE MLA"): with
// mla_use_nope no pair is rotated (the dr dims stay, unrotated), and with
// mla_use_output_gate the heads' output is multiplied by sigmoid(wg x)
// before wo ("wg.weight", Kimi's g_proj).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <string>
#include <vector>

#include "mla/config.hpp"

namespace laga::test {

using NaiveTensors = std::map<std::string, std::vector<double>>;

struct NaiveMlaResult {
  std::vector<double> out, dx;  // (B, S, D)
  NaiveTensors grads;           // same names and sizes as the parameters
};

namespace naive_detail {

using I = std::int64_t;

// precompute_freqs_cis: base^(-2i/dr), blended towards freq/factor by YaRN's
// linear ramp between the pairs that turn beta_fast and beta_slow times over
// the original context.
inline std::vector<double> rope_freqs(const MlaConfig& c) {
  const I dr = c.qk_rope_head_dim;
  std::vector<double> f(static_cast<std::size_t>(dr / 2));
  const bool yarn = c.max_seq_len > c.original_seq_len;
  double lo = 0, hi = 1;
  if (yarn) {
    auto pair_turning = [&](double turns) {
      return double(dr) * std::log(double(c.original_seq_len) / (turns * 2 * std::numbers::pi)) /
             (2 * std::log(c.rope_theta));
    };
    lo = std::max(std::floor(pair_turning(c.beta_fast)), 0.0);
    hi = std::min(std::ceil(pair_turning(c.beta_slow)), double(dr - 1));
    if (lo == hi) hi += 0.001;
  }
  for (I i = 0; i < dr / 2; ++i) {
    const double base = std::pow(c.rope_theta, -2.0 * double(i) / double(dr));
    double v = base;
    if (yarn) {
      const double ramp = std::clamp((double(i) - lo) / (hi - lo), 0.0, 1.0);
      v = ramp * base / c.rope_factor + (1 - ramp) * base;
    }
    f[static_cast<std::size_t>(i)] = v;
  }
  return f;
}

inline double softmax_scale(const MlaConfig& c) {
  double s = 1.0 / std::sqrt(double(c.qk_nope_head_dim + c.qk_rope_head_dim));
  // NoPE: nothing rotates, so no YaRN and no mscale (Kimi K3: (dn + dr)^-1/2).
  const bool rotates = !c.mla_use_nope && c.qk_rope_head_dim > 0;
  if (rotates && c.max_seq_len > c.original_seq_len) {
    const double m = 0.1 * c.mscale * std::log(c.rope_factor) + 1.0;
    s *= m * m;
  }
  return s;
}

// Rotates the interleaved pairs of v[0..dr) by angle t * f_i (sign -1: the
// inverse rotation, which is the rotation's backward).
inline void rotate(double* v, I dr, const std::vector<double>& f, I t, double sign) {
  for (I i = 0; i < dr / 2; ++i) {
    const double a = sign * double(t) * f[static_cast<std::size_t>(i)];
    const double c = std::cos(a), s = std::sin(a), x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * c - x1 * s;
    v[2 * i + 1] = x0 * s + x1 * c;
  }
}

// y (n_out) = W (n_out, n_in) x
inline void matvec(const std::vector<double>& W, const double* x, I n_out, I n_in, double* y) {
  for (I o = 0; o < n_out; ++o) {
    double s = 0;
    for (I i = 0; i < n_in; ++i) s += W[static_cast<std::size_t>(o * n_in + i)] * x[i];
    y[o] = s;
  }
}
// dx (n_in) += W^T dy, dW += dy x^T
inline void matvec_backward(const std::vector<double>& W, const double* x, const double* dy,
                            I n_out, I n_in, double* dx, std::vector<double>& dW) {
  for (I o = 0; o < n_out; ++o)
    for (I i = 0; i < n_in; ++i) {
      const std::size_t k = static_cast<std::size_t>(o * n_in + i);
      if (dx) dx[i] += W[k] * dy[o];
      dW[k] += dy[o] * x[i];
    }
}

// y = v / sqrt(mean(v^2) + eps) * g; returns r = 1 / sqrt(mean(v^2) + eps).
inline double rmsnorm(const double* v, const std::vector<double>& g, I n, double eps, double* y) {
  double ss = 0;
  for (I i = 0; i < n; ++i) ss += v[i] * v[i];
  const double r = 1.0 / std::sqrt(ss / double(n) + eps);
  for (I i = 0; i < n; ++i) y[i] = v[i] * r * g[static_cast<std::size_t>(i)];
  return r;
}
// dv = r g dy - v r^3 <g dy, v> / n;  dg += dy v r
inline void rmsnorm_backward(const double* v, const std::vector<double>& g, I n, double r,
                             const double* dy, double* dv, std::vector<double>& dg) {
  double gdv = 0;
  for (I i = 0; i < n; ++i) gdv += g[static_cast<std::size_t>(i)] * dy[i] * v[i];
  for (I i = 0; i < n; ++i) {
    dv[i] = r * g[static_cast<std::size_t>(i)] * dy[i] - v[i] * r * r * r * gdv / double(n);
    dg[static_cast<std::size_t>(i)] += dy[i] * v[i] * r;
  }
}

}  // namespace naive_detail

// Forward and backward of the block on the whole (B, S) batch.
inline NaiveMlaResult naive_mla(const MlaConfig& c, const NaiveTensors& w,
                                const std::vector<double>& x, const std::vector<double>& dout,
                                std::int64_t B, std::int64_t S) {
  using namespace naive_detail;
  const I D = c.dim, H = c.n_heads, rq = c.q_lora_rank, C = c.kv_lora_rank;
  const I dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim, dqk = dn + dr;
  const double eps = c.norm_eps, scale = softmax_scale(c);
  // NoPE: every angle zero (the identity), written as a zero frequency.
  std::vector<double> f = rope_freqs(c);
  if (c.mla_use_nope) std::fill(f.begin(), f.end(), 0.0);
  const bool gated = c.mla_use_output_gate;
  auto W = [&](const char* name) -> const std::vector<double>& { return w.at(name); };
  auto z = [](I i) { return static_cast<std::size_t>(i); };

  NaiveMlaResult res;
  res.out.assign(z(B * S * D), 0.0);
  res.dx.assign(z(B * S * D), 0.0);
  for (const auto& [name, v] : w) res.grads[name].assign(v.size(), 0.0);
  auto G = [&](const char* name) -> std::vector<double>& { return res.grads.at(name); };

  for (I b = 0; b < B; ++b) {
    // Per token: what the forward computes, kept for the backward.
    std::vector<double> qa(z(S * rq)), q_r(z(S)), qn(z(S * rq));
    std::vector<double> q(z(S * H * dqk)), kva(z(S * (C + dr))), kv_r(z(S)), ch(z(S * C));
    std::vector<double> k(z(S * H * dqk)), v(z(S * H * dv)), o(z(S * H * dv));
    std::vector<double> lse(z(H * S));
    std::vector<double> gs(gated ? z(S * H * dv) : 0);  // sigmoid(wg x) per token
#pragma omp parallel for
    for (I t = 0; t < S; ++t) {
      const double* xt = &x[z((b * S + t) * D)];
      double* qt = &q[z(t * H * dqk)];
      if (rq == 0) {
        matvec(W("wq.weight"), xt, H * dqk, D, qt);
      } else {
        matvec(W("wq_a.weight"), xt, rq, D, &qa[z(t * rq)]);
        q_r[z(t)] = rmsnorm(&qa[z(t * rq)], W("q_norm.weight"), rq, eps, &qn[z(t * rq)]);
        matvec(W("wq_b.weight"), &qn[z(t * rq)], H * dqk, rq, qt);
      }
      for (I h = 0; h < H; ++h) rotate(qt + h * dqk + dn, dr, f, t, 1.0);
      double* kt = &kva[z(t * (C + dr))];
      matvec(W("wkv_a.weight"), xt, C + dr, D, kt);
      kv_r[z(t)] = rmsnorm(kt, W("kv_norm.weight"), C, eps, &ch[z(t * C)]);
      std::vector<double> kpe(kt + C, kt + C + dr), kvb(z(H * (dn + dv)));
      rotate(kpe.data(), dr, f, t, 1.0);
      matvec(W("wkv_b.weight"), &ch[z(t * C)], H * (dn + dv), C, kvb.data());
      for (I h = 0; h < H; ++h) {
        for (I i = 0; i < dn; ++i) k[z((t * H + h) * dqk + i)] = kvb[z(h * (dn + dv) + i)];
        for (I i = 0; i < dr; ++i) k[z((t * H + h) * dqk + dn + i)] = kpe[z(i)];
        for (I i = 0; i < dv; ++i) v[z((t * H + h) * dv + i)] = kvb[z(h * (dn + dv) + dn + i)];
      }
    }
    // Attention, one (head, query) row at a time; the row's log-sum-exp is
    // kept and the probabilities are recomputed in the backward.
    auto score = [&](I h, I t, I u) {
      double s = 0;
      for (I i = 0; i < dqk; ++i) s += q[z((t * H + h) * dqk + i)] * k[z((u * H + h) * dqk + i)];
      return scale * s;
    };
#pragma omp parallel for
    for (I h = 0; h < H; ++h)
      for (I t = 0; t < S; ++t) {
        std::vector<double> p(z(t + 1));
        double m = -INFINITY;
        for (I u = 0; u <= t; ++u) m = std::max(m, p[z(u)] = score(h, t, u));
        double sum = 0;
        for (I u = 0; u <= t; ++u) sum += (p[z(u)] = std::exp(p[z(u)] - m));
        lse[z(h * S + t)] = m + std::log(sum);
        for (I i = 0; i < dv; ++i) {
          double acc = 0;
          for (I u = 0; u <= t; ++u) acc += p[z(u)] / sum * v[z((u * H + h) * dv + i)];
          o[z((t * H + h) * dv + i)] = acc;
        }
      }
    // The output gate: y = o * sigmoid(wg x), then wo. ungated keeps o.
    std::vector<double> y = o;
    if (gated)
      for (I t = 0; t < S; ++t) {
        std::vector<double> g(z(H * dv));
        matvec(W("wg.weight"), &x[z((b * S + t) * D)], H * dv, D, g.data());
        for (I i = 0; i < H * dv; ++i) {
          const double s = 1.0 / (1.0 + std::exp(-g[z(i)]));
          gs[z(t * H * dv + i)] = s;
          y[z(t * H * dv + i)] = o[z(t * H * dv + i)] * s;
        }
      }
    for (I t = 0; t < S; ++t)
      matvec(W("wo.weight"), &y[z(t * H * dv)], D, H * dv, &res.out[z((b * S + t) * D)]);

    // Backward.
    std::vector<double> d_o(z(S * H * dv), 0.0), dq(z(S * H * dqk), 0.0), dk(z(S * H * dqk), 0.0),
        d_v(z(S * H * dv), 0.0);
    for (I t = 0; t < S; ++t)
      matvec_backward(W("wo.weight"), &y[z(t * H * dv)], &dout[z((b * S + t) * D)], D, H * dv,
                      &d_o[z(t * H * dv)], G("wo.weight"));
    if (gated)  // d_o holds dy: dg = dy o s (1 - s) to wg and dx; d_o = dy s
      for (I t = 0; t < S; ++t) {
        std::vector<double> dg(z(H * dv));
        for (I i = 0; i < H * dv; ++i) {
          const std::size_t j = z(t * H * dv + i);
          dg[z(i)] = d_o[j] * o[j] * gs[j] * (1.0 - gs[j]);
          d_o[j] *= gs[j];
        }
        matvec_backward(W("wg.weight"), &x[z((b * S + t) * D)], dg.data(), H * dv, D,
                        &res.dx[z((b * S + t) * D)], G("wg.weight"));
      }
      // dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q,
      // dV = P^T dO. Heads touch disjoint parts of dq, dk and d_v.
#pragma omp parallel for
    for (I h = 0; h < H; ++h)
      for (I t = 0; t < S; ++t) {
        const double* dot = &d_o[z((t * H + h) * dv)];
        std::vector<double> p(z(t + 1)), dp(z(t + 1));
        double pdp = 0;
        for (I u = 0; u <= t; ++u) {
          p[z(u)] = std::exp(score(h, t, u) - lse[z(h * S + t)]);
          double s = 0;
          for (I i = 0; i < dv; ++i) {
            s += dot[i] * v[z((u * H + h) * dv + i)];
            d_v[z((u * H + h) * dv + i)] += p[z(u)] * dot[i];
          }
          dp[z(u)] = s;
          pdp += p[z(u)] * s;
        }
        for (I u = 0; u <= t; ++u) {
          const double ds = scale * p[z(u)] * (dp[z(u)] - pdp);
          for (I i = 0; i < dqk; ++i) {
            dq[z((t * H + h) * dqk + i)] += ds * k[z((u * H + h) * dqk + i)];
            dk[z((u * H + h) * dqk + i)] += ds * q[z((t * H + h) * dqk + i)];
          }
        }
      }
    for (I t = 0; t < S; ++t) {
      const double* xt = &x[z((b * S + t) * D)];
      double* dxt = &res.dx[z((b * S + t) * D)];
      // Keys and values back to the latent.
      std::vector<double> dkvb(z(H * (dn + dv))), dkpe(z(dr), 0.0);
      for (I h = 0; h < H; ++h) {
        for (I i = 0; i < dn; ++i) dkvb[z(h * (dn + dv) + i)] = dk[z((t * H + h) * dqk + i)];
        for (I i = 0; i < dv; ++i) dkvb[z(h * (dn + dv) + dn + i)] = d_v[z((t * H + h) * dv + i)];
        for (I i = 0; i < dr; ++i) dkpe[z(i)] += dk[z((t * H + h) * dqk + dn + i)];
      }
      rotate(dkpe.data(), dr, f, t, -1.0);
      std::vector<double> dch(z(C), 0.0), dkva(z(C + dr));
      matvec_backward(W("wkv_b.weight"), &ch[z(t * C)], dkvb.data(), H * (dn + dv), C, dch.data(),
                      G("wkv_b.weight"));
      rmsnorm_backward(&kva[z(t * (C + dr))], W("kv_norm.weight"), C, kv_r[z(t)], dch.data(),
                       dkva.data(), G("kv_norm.weight"));
      for (I i = 0; i < dr; ++i) dkva[z(C + i)] = dkpe[z(i)];
      matvec_backward(W("wkv_a.weight"), xt, dkva.data(), C + dr, D, dxt, G("wkv_a.weight"));
      // Queries.
      double* dqt = &dq[z(t * H * dqk)];
      for (I h = 0; h < H; ++h) rotate(dqt + h * dqk + dn, dr, f, t, -1.0);
      if (rq == 0) {
        matvec_backward(W("wq.weight"), xt, dqt, H * dqk, D, dxt, G("wq.weight"));
      } else {
        std::vector<double> dqn(z(rq), 0.0), dqa(z(rq));
        matvec_backward(W("wq_b.weight"), &qn[z(t * rq)], dqt, H * dqk, rq, dqn.data(),
                        G("wq_b.weight"));
        rmsnorm_backward(&qa[z(t * rq)], W("q_norm.weight"), rq, q_r[z(t)], dqn.data(), dqa.data(),
                         G("q_norm.weight"));
        matvec_backward(W("wq_a.weight"), xt, dqa.data(), rq, D, dxt, G("wq_a.weight"));
      }
    }
  }
  return res;
}

}  // namespace laga::test
