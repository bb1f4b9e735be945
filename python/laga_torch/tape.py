"""The whole block as one autograd.Function per call, keeping for backward
what the C++ form's tape keeps (MlaSaved, docs/forms.md "What each form saves
for backward") and nothing else: the paper's memory point, which autograd's
own choices would blur (a composed absorbed form, for one, keeps every
einsum's inputs). Forward and backward read as docs/forms.md's blocks for
each form and as src/mla/form_*.cpp; the movements are comm.move with the C++
labels, the rings' ring.ring_forward / ring_backward; which movements a form
makes is its FORMS row (forms.FormSpec: attends, keys). Attention is the C++ tool's choice (run.flash): eager (the
probabilities saved) or flash (attention.flash_forward: o and the
log-sum-exp per row saved, the probabilities recomputed tile by tile in
backward).

Saved, per rank (B, L local tokens, S all, H_r heads; rq = q_lora_rank):
  every form   kv_a (B, L, C+dr) [rq > 0: with qa, the fused proj], kv_rstd,
               qa, qn, q_rstd (rq > 0; q_latent: qn_q in place of qn), o_loc;
               mla_use_output_gate: the gate's logits g = x wg^T (B, L, H dv)
  explicit     q_h, k_h, v_h, c_hat (local tokens); eager: probs;
               flash: o_h (B, S, H_r, dv), lse (B, H_r, S)
  laga/laga2d  q_h, k_h, v_h (laga2d: its query rows / keys), lat (B, S, C+dr);
               eager: probs per query range; flash: o_h, lse over the query rows
  laga_fused   flash: q_h, lat, o_h, lse (no k_h, v_h: backward makes them
               again from lat, fused.py); eager: laga's
  absorbed     q_h, lat, v_lat, q_abs, o_lat; eager: probs; flash: lse
               (o_lat, which d W_UV needs, is flash's output)
  allgather_kv q_h (B, L, H, dqk), c_hat, k_h, v_h (B, S, H, .) gathered;
               eager: probs (B, H, rows, e) per own seq range [b, e) (one on
               contiguous shards, two on zigzag); flash: lse (o_h is o_loc)
  ring_kv      q_h, c_hat, own = the flat [K | V] block of local tokens;
               eager: each step's probs over its rectangle (rescaled to the
               row's whole normalisation); flash: the merged lse (ring.py)
  ring_latent  q_h, own = the flat [c_hat | k_pe]; the statistics as ring_kv
  a2a_p2p      q_h (B, Sq, H_g, dqk) of its grid's rows, own = the flat
               [K | V] of them, o_h (the merged o, B, Sq, H_g, dv), c_hat;
               the statistics as ring_kv, over its head group's ring
The closed form is src/mla/memory_model.cpp's saved_for_backward_elements
(which also counts the output); tools_torch_package holds the two equal, for
eager and for flash. In bf16 flash keeps lse in fp32 (its statistics'
type), where the closed form counts bf16's 2 bytes.
"""

import torch

from .attention import _acc_dtype, first_order_only, math_backward, math_forward
from . import dispatch
from .dispatch import backward as flash_backward, forward as flash_forward
from . import fused
from .comm import _unpack_add, move
from .forms import Attends, Keys
from .norm import rms_backward, rms_forward
from .ring import ring_backward, ring_forward
from . import invariant


def _rot(x, cos, sin, inverse=False):
    """Interleaved-pair rotation of x (B, T, heads, dr) by (cos, sin) (B, T, 1, dr/2);
    inverse: by minus the angle, the forward rotation's adjoint. x itself
    when nothing rotates (NoPE: cos None, _trig)."""
    if cos is None:
        return x
    a, b = x[..., 0::2], x[..., 1::2]
    if inverse:
        sin = -sin
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def _trig(sp, pos):
    """(cos, sin) (B, T, 1, dr/2) at positions pos (B, T); (None, None) when
    nothing rotates (NoPE, module.rope_tables)."""
    if sp.cos is None:
        return None, None
    return sp.cos[pos][:, :, None], sp.sin[pos][:, :, None]


def _mask_of(sp, rows, keys):
    """The eager mask of query rows over keys [0, keys), built only when
    math_backward needs it (a non-finite operand)."""
    return lambda: sp.mask(rows, keys)


def _mm_t(a, b):
    """a^T b over every leading axis: (..., m)^T (..., n) -> (m, n)."""
    return a.flatten(0, -2).t() @ b.flatten(0, -2)


def _local_mm(run):
    """a @ w of the rank's token rows: one GEMM, or in the invariant mode
    blocks aligned to the global sequence (invariant.rows_mm)."""
    if run.tree is None:
        return lambda a, w: a @ w
    return lambda a, w: invariant.rows_mm(a, w, run.sp.own)


def _up_heads(lat, w_heads, cfg):
    """The invariant mode's up-projection: k (B, Sk, nh, dqk), v of the
    latent, each head's GEMM alone (its columns the same at every nh)."""
    C, dn, dr = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    B, Sk, nh = lat.shape[0], lat.shape[1], w_heads.shape[0]
    kv = invariant.per_head_mm(lat[..., :C], w_heads.reshape(-1, C), nh, w_heads.shape[1])
    k = torch.cat([kv[..., :dn], lat[:, :, None, C:].expand(B, Sk, nh, dr)], -1)
    return k, kv[..., dn:].contiguous()


class Block(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, run, *weights):
        cfg, sp, form = run.cfg, run.sp, run.form
        W = dict(zip(run.names, weights))
        B, L = x.shape[:2]
        H, C, dn, dr, dv, rq = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        dqk, eps, scale = dn + dr, cfg.norm_eps, cfg.softmax_scale()
        own_pos = sp.pos[:, sp.own]  # the own tokens' in-document positions
        trig = _trig(sp, own_pos)
        rows = run.rows
        h0, nh = run.heads
        keep = {}
        mm = _local_mm(run)

        # Local: q (or the query latent), kv_a = [c | k_pe], c_hat.
        q = None
        if rq == 0:
            q = mm(x, W["wq.weight"].t())
        else:
            qa = mm(x, W["wq_a.weight"].t())
            qn, q_rstd = rms_forward(qa, W["q_norm.weight"], eps)
            keep.update(qa=qa, q_rstd=q_rstd)
            if not run.q_latent:
                keep["qn"] = qn
                q = mm(qn, W["wq_b.weight"].t())
        if q is not None:
            q = q.view(B, L, H, dqk)
            q = torch.cat([q[..., :dn], _rot(q[..., dn:], *trig)], -1)
        kv_a = mm(x, W["wkv_a.weight"].t())
        if cfg.rotates:
            kv_a[..., C:] = _rot(kv_a[..., None, C:], *trig)[:, :, 0]  # k_pe rotated in place
        c_hat, kv_rstd = rms_forward(kv_a[..., :C], W["kv_norm.weight"], eps)
        keep.update(kv_a=kv_a, kv_rstd=kv_rstd)
        wkv = W["wkv_b.weight"].view(H, dn + dv, C)

        def queries():
            if not run.q_latent:
                return move(q, run.plans["q"], sp.group, sp.ledger, "forward")
            qn_q = move(qn.unsqueeze(2), run.plans["q"], sp.group, sp.ledger, "forward")[:, :, 0]
            keep["qn_q"] = qn_q
            w_q = W["wq_b.weight"][h0 * dqk:(h0 + nh) * dqk]
            if run.tree is not None:  # each head's GEMM alone
                q_h = invariant.per_head_mm(qn_q, w_q, nh, dqk)
            else:
                q_h = (qn_q @ w_q.t()).view(B, qn_q.shape[1], nh, dqk)
            t = _trig(sp, sp.pos[:, rows])
            return torch.cat([q_h[..., :dn], _rot(q_h[..., dn:], *t)], -1)

        spec = run.spec
        grid_ring = spec.ring and spec.attends is Attends.grid  # a2a_p2p
        if spec.keys in (Keys.heads, Keys.gather) or grid_ring:
            # kv of the local tokens for ALL heads, k_pe expanded over heads.
            kv = mm(c_hat, W["wkv_b.weight"].t()).view(B, L, H, dn + dv)
            k = torch.cat([kv[..., :dn], kv_a[:, :, None, C:].expand(B, L, H, dr)], -1)
        if spec.attends is Attends.own:  # the own tokens with all heads: no exchange of q or o
            keep["q_h"] = q
            if spec.keys is Keys.gather:  # allgather_kv: every token's K and V gathered
                keep["c_hat"] = c_hat
                S, Sk = sp.layout.seq, run.key_end
                k_h = move(k.reshape(B, L, 1, H * dqk), run.plans["k"], sp.group, sp.ledger,
                           "forward").view(B, S, H, dqk)
                v_h = move(kv[..., dn:].reshape(B, L, 1, H * dv), run.plans["v"], sp.group,
                           sp.ledger, "forward").view(B, S, H, dv)
                keep.update(k_h=k_h, v_h=v_h)
                if run.tree is not None:  # the own rows in chunks of the global sequence
                    o_h, lse = _gather_attend_invariant(run, q, k_h, v_h)
                    if run.flash:
                        keep["lse"] = lse
                else:
                    o_h = q.new_zeros(B, L, H, dv)  # o_loc's storage, which every form keeps
                    if run.flash:
                        keep["lse"] = torch.zeros(B, H, L, dtype=_acc_dtype(q.dtype),
                                                  device=q.device)
                    for i, (a, b, e) in enumerate(run.calls):  # one call per own seq range
                        if run.flash:
                            o_h[:, a:b], keep["lse"][:, :, a:b] = flash_forward(
                                q[:, a:b], k_h[:, :e], v_h[:, :e], sp.key_ranges(rows[a:b], e),
                                scale, run.block)
                        else:
                            o_h[:, a:b], keep[f"p{i}"] = math_forward(
                                q[:, a:b], k_h[:, :e], v_h[:, :e], sp.mask(rows[a:b], e), scale)
            else:  # the ring forms: the own block round the ring (ring.py)
                codec = spec.codec(cfg, B, W["wkv_b.weight"])
                own = codec.own_block(c_hat, kv_a[..., C:])
                if codec.keeps_c_hat:  # ring_kv: for wkv_b's gradient at home
                    keep["c_hat"] = c_hat
                o_h, stats = ring_forward(sp, codec, q, own, run.flash, run.block, run.overlap,
                                          scale)
                keep["own"] = own
                if run.flash:
                    keep["lse"] = stats
                else:
                    keep.update({f"p{i}": p for i, p in stats.items()})
        elif grid_ring:  # a2a_p2p: q, k, v to the grid, the [K | V] round the head group's ring
            q_h = queries()
            k_h = move(k, run.plans["k"], sp.group, sp.ledger, "forward")
            v_h = move(kv[..., dn:], run.plans["v"], sp.group, sp.ledger, "forward")
            own = torch.cat([k_h.reshape(-1), v_h.reshape(-1)])
            del k_h, v_h
            codec = spec.codec(cfg, B, W["wkv_b.weight"], heads=nh)
            o_h, stats = ring_forward(sp.head_group_ring(), codec, q_h, own, run.flash, run.block,
                                      run.overlap, scale)
            keep.update(q_h=q_h, own=own, o_h=o_h, c_hat=c_hat)
            if run.flash:
                keep["lse"] = stats
            else:
                keep.update({f"p{i}": p for i, p in stats.items()})
        elif spec.keys is Keys.heads:  # explicit
            q_h = queries()
            k_h = move(k, run.plans["k"], sp.group, sp.ledger, "forward")
            v_h = move(kv[..., dn:], run.plans["v"], sp.group, sp.ledger, "forward")
            if run.flash:
                o_h, lse = flash_forward(q_h, k_h, v_h, sp.key_ranges(rows, sp.layout.seq), scale,
                                         run.block)
                keep.update(q_h=q_h, k_h=k_h, v_h=v_h, o_h=o_h, lse=lse, c_hat=c_hat)
            else:
                o_h, p = math_forward(q_h, k_h, v_h, sp.mask(rows, sp.layout.seq), scale)
                keep.update(q_h=q_h, k_h=k_h, v_h=v_h, p0=p, c_hat=c_hat)
        else:
            lat_loc = torch.cat([c_hat, kv_a[..., C:]], -1).unsqueeze(2)
            if run.overlap:  # on the wire while the queries move
                started = []
                flat = move(lat_loc, run.plans["lat"], sp.group, sp.ledger, "forward",
                            started=started)
                q_h = queries()
                started[0].wait()
                lat = _unpack_add(flat, run.plans["lat"].recv, run.plans["lat"].dst_shape)
            else:
                q_h = queries()
                lat = move(lat_loc, run.plans["lat"], sp.group, sp.ledger, "forward")
            lat = lat[:, :, 0]
            keep.update(q_h=q_h, lat=lat)
            if form == "absorbed":
                v_lat = lat[..., :C].contiguous()  # the kernel's contiguous values
                if run.tree is not None:  # one head's GEMM at a time
                    q_abs = torch.cat([invariant.per_head(
                        lambda i: q_h[:, :, i, :dn] @ wkv[h0 + i, :dn], nh,
                        q_h.new_zeros(B, len(rows), 0, C)), q_h[..., dn:]], -1)
                else:
                    q_abs = torch.cat([torch.einsum("bshn,hnc->bshc", q_h[..., :dn],
                                                    wkv[h0:h0 + nh, :dn]), q_h[..., dn:]], -1)
                if run.flash:  # o_lat is kept either way (d W_UV): flash adds only lse
                    o_lat, stats = flash_forward(q_abs, lat[:, :, None], v_lat[:, :, None],
                                                 sp.key_ranges(rows, sp.layout.seq), scale,
                                                 run.block)
                else:
                    o_lat, stats = math_forward(q_abs, lat[:, :, None], v_lat[:, :, None],
                                                sp.mask(rows, sp.layout.seq), scale)
                if run.tree is not None:
                    o_h = invariant.per_head(lambda i: o_lat[:, :, i] @ wkv[h0 + i, dn:].t(), nh,
                                             o_lat.new_zeros(B, len(rows), 0, dv))
                else:
                    o_h = torch.einsum("bshc,hvc->bshv", o_lat, wkv[h0:h0 + nh, dn:])
                keep.update(v_lat=v_lat, q_abs=q_abs, o_lat=o_lat)
                keep["lse" if run.flash else "p0"] = stats
            else:  # laga, laga2d: the own heads up-projected over the keys needed
                Sk = run.key_end
                w_r = wkv[h0:h0 + nh].reshape(-1, C)
                triton = spec.fused and run.flash and run.tree is None and fused.kernel_for(
                    q_h, lat, w_r) is fused.FusedKernel.triton
                if run.tree is not None:  # each head's up-projection alone
                    k_h, v_h = _up_heads(lat[:, :Sk], wkv[h0:h0 + nh], cfg)
                elif triton:  # laga_fused's Triton kernel: K/V a key tile at a time, on chip
                    k_h = v_h = None
                elif spec.fused and run.flash:  # laga_fused: K/V for the call only (fused.py)
                    k_h, v_h = fused.up_project(lat[:, :Sk], w_r, cfg)
                else:
                    kv_h = (lat[:, :Sk, :C] @ wkv[h0:h0 + nh].reshape(-1, C).t()).view(
                        B, Sk, nh, dn + dv)
                    k_h = torch.cat([kv_h[..., :dn], lat[:, :Sk, None, C:].expand(
                        B, Sk, nh, dr)], -1)
                    v_h = kv_h[..., dn:].contiguous()
                o_h = q_h.new_zeros(B, len(rows), nh, dv)
                if run.flash:  # o_h and lse (B, H_r, Sq) over every query range
                    lse = torch.zeros(B, nh, len(rows), dtype=_acc_dtype(q_h.dtype),
                                      device=q_h.device)
                for i, (a, b, e) in enumerate(run.calls):  # one call per query range
                    if triton:
                        o_h[:, a:b], lse[:, :, a:b] = fused.fused_triton.forward(
                            q_h[:, a:b], lat[:, :e], w_r, sp.key_ranges(rows[a:b], e), scale,
                            cfg)
                    elif run.flash:
                        o_h[:, a:b], lse[:, :, a:b] = flash_forward(
                            q_h[:, a:b], k_h[:, :e], v_h[:, :e], sp.key_ranges(rows[a:b], e),
                            scale, run.block)
                    else:
                        o_h[:, a:b], keep[f"p{i}"] = math_forward(
                            q_h[:, a:b], k_h[:, :e], v_h[:, :e], sp.mask(rows[a:b], e), scale)
                if not (spec.fused and run.flash):
                    keep.update(k_h=k_h, v_h=v_h)
                del k_h, v_h
                if run.flash:
                    keep.update(o_h=o_h, lse=lse)
        if spec.attends is Attends.own:
            o_loc = o_h.reshape(B, L, H * dv)
        else:
            o_loc = move(o_h, run.plans["out"], sp.group, sp.ledger, "forward").reshape(
                B, L, H * dv)
        keep["o_loc"] = o_loc
        if cfg.mla_use_output_gate:
            # Kimi K3's output gate (docs/mla-math.md, "Gated NoPE MLA"; the C++
            # Pieces::output_projection): the logits g = x wg^T saved, y = o *
            # sigmoid(g) made again in backward rather than saved.
            keep["gate"] = mm(x, W["wg.weight"].t())
            o_loc = o_loc * torch.sigmoid(keep["gate"])
        ctx.run, ctx.names = run, list(keep)
        ctx.save_for_backward(x, *weights, *keep.values())
        return mm(o_loc, W["wo.weight"].t())

    @staticmethod
    @first_order_only("laga's tape (MLA(tape='laga'), the default)",
                      "MLA(..., tape='autograd') with attention 'eager' or 'flash' and a form "
                      "without a ring (explicit, absorbed, laga, laga2d or allgather_kv)")
    def backward(ctx, dout):
        with dispatch.context(ctx.run.sp.ledger, ctx.run.kernel):
            return Block._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        run = ctx.run
        cfg, sp, form = run.cfg, run.sp, run.form
        saved = ctx.saved_tensors
        x, weights = saved[0], saved[1:1 + len(run.names)]
        W = dict(zip(run.names, weights))
        s = dict(zip(ctx.names, saved[1 + len(run.names):]))
        B, L = x.shape[:2]
        H, C, dn, dr, dv, rq = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        dqk, scale = dn + dr, cfg.softmax_scale()
        own_pos = sp.pos[:, sp.own]  # the own tokens' in-document positions
        trig = _trig(sp, own_pos)
        rows = run.rows
        h0, nh = run.heads
        G = {n: None for n in run.names}
        wkv = W["wkv_b.weight"].view(H, dn + dv, C)
        d_wkv = torch.zeros_like(wkv)
        tree, mm = run.tree, _local_mm(run)
        # a weight's gradient over the rank's tokens: its part (sync_gradients
        # sums the parts), or in the invariant mode the whole sequence's, summed
        # in the token tree (invariant.TokenTree) on every rank
        wgrad = _mm_t if tree is None else tree.weight_grad

        spec = run.spec
        d_gate = None
        if cfg.mla_use_output_gate:  # y = o * s, s = sigmoid(g): do = dy s, dg = dy o s (1 - s)
            sg = torch.sigmoid(s["gate"])
            G["wo.weight"] = wgrad(dout, s["o_loc"] * sg)
            dy = mm(dout, W["wo.weight"])
            d_gate = dy * s["o_loc"] * sg * (1 - sg)
            G["wg.weight"] = wgrad(d_gate, x)
            d_o = (dy * sg).view(B, L, H, dv)
        else:
            G["wo.weight"] = wgrad(dout, s["o_loc"])
            d_o = mm(dout, W["wo.weight"]).view(B, L, H, dv)
        if spec.attends is Attends.own:
            do_h = d_o
        else:
            do_h = move(d_o, run.plans["out"], sp.group, sp.ledger, "backward", adjoint=True)

        def merge_heads(dk, dvv, c_hat):
            """explicit's local merge of per-head dK (B, L, H, dqk) and dV of
            local tokens: (d c_hat, d k_pe = sum over heads, d wkv_b)."""
            dkv = torch.cat([dk[..., :dn], dvv], -1).reshape(B, L, H * (dn + dv))
            d_kpe = dk[..., dn:].sum(2) if tree is None else \
                invariant.head_tree_sum(dk[..., dn:], 2)
            return mm(dkv, W["wkv_b.weight"]), d_kpe, wgrad(dkv, c_hat).view(H, dn + dv, C)

        def queries_back(dq_h):
            """dq_h of the rank's heads and query rows -> dq (B, L, H, dqk) of its
            tokens, or with q_latent d qn (B, L, rq) (wq_b's gradient taken here)."""
            if not run.q_latent:
                return move(dq_h, run.plans["q"], sp.group, sp.ledger, "backward", adjoint=True)
            t = _trig(sp, sp.pos[:, rows])
            dq_h = torch.cat([dq_h[..., :dn], _rot(dq_h[..., dn:], *t, inverse=True)], -1)
            if tree is not None:  # per head, and summed over the heads in the head tree
                w_q = W["wq_b.weight"].view(H, dqk, -1)
                G["wq_b.weight"] = invariant.gather_head_rows(torch.cat(
                    [invariant.local_token_grad(dq_h[:, :, i], s["qn_q"]) for i in range(nh)])
                    if nh else W["wq_b.weight"].new_zeros(0, rq),
                    sp.layout, sp.rank, sp.group, dqk, sp.ledger)
                d_qn = invariant.per_head(lambda i: dq_h[:, :, i] @ w_q[h0 + i], nh,
                                          dq_h.new_zeros(B, dq_h.shape[1], 0, rq))
                return invariant.head_tree_sum(move(d_qn, sp.plan("head_to_seq", rq,
                                                                  "q_latent_heads"),
                                                    sp.group, sp.ledger, "backward"), 2)
            dq_h = dq_h.reshape(B, dq_h.shape[1], nh * dqk)
            g = torch.zeros_like(W["wq_b.weight"])
            g[h0 * dqk:(h0 + nh) * dqk] = _mm_t(dq_h, s["qn_q"])
            G["wq_b.weight"] = g
            d_qn = dq_h @ W["wq_b.weight"][h0 * dqk:(h0 + nh) * dqk]
            return move(d_qn.unsqueeze(2), run.plans["q"], sp.group, sp.ledger, "backward",
                        adjoint=True)[:, :, 0]

        if spec.keys is Keys.gather and tree is not None:  # allgather_kv, invariant
            dk, dvv, dq = _gather_backward_invariant(run, s, do_h)
            d_chat, d_kpe, d_wkv = merge_heads(dk, dvv, s["c_hat"])
        elif spec.keys is Keys.gather:  # allgather_kv
            S, Sk = sp.layout.seq, run.key_end
            q, k_h, v_h = s["q_h"], s["k_h"][:, :Sk], s["v_h"][:, :Sk]
            o_h = s["o_loc"].view(B, L, H, dv)  # flash's o is o_loc, which every form keeps
            dq, dk_h, dv_h = torch.zeros_like(q), torch.zeros_like(k_h), torch.zeros_like(v_h)
            for i, (a, b, e) in enumerate(run.calls):  # one call per own seq range
                if run.flash:
                    dq_, dk_, dv_ = flash_backward(
                        q[:, a:b], k_h[:, :e], v_h[:, :e], o_h[:, a:b], s["lse"][:, :, a:b],
                        do_h[:, a:b], sp.key_ranges(rows[a:b], e), scale, run.block)
                else:
                    dq_, dk_, dv_ = math_backward(q[:, a:b], k_h[:, :e], v_h[:, :e], s[f"p{i}"],
                                                  do_h[:, a:b], scale,
                                                  see=_mask_of(sp, rows[a:b], e))
                dq[:, a:b] = dq_
                dk_h[:, :e] += dk_
                dv_h[:, :e] += dv_
            # The all-gathers' adjoints: the keys' gradients (zero past s1 from
            # this rank) reduce-scattered to their owners.
            dk_all = dk_h.new_zeros(B, S, 1, H * dqk)
            dk_all[:, :Sk, 0] = dk_h.reshape(B, Sk, H * dqk)
            dv_all = dv_h.new_zeros(B, S, 1, H * dv)
            dv_all[:, :Sk, 0] = dv_h.reshape(B, Sk, H * dv)
            dk = move(dk_all, run.plans["k"], sp.group, sp.ledger, "backward", adjoint=True)
            dvv = move(dv_all, run.plans["v"], sp.group, sp.ledger, "backward", adjoint=True)
            d_chat, d_kpe, d_wkv = merge_heads(dk.view(B, L, H, dqk), dvv.view(B, L, H, dv),
                                               s["c_hat"])
        elif spec.ring and spec.attends is Attends.grid:  # a2a_p2p
            codec = spec.codec(cfg, B, W["wkv_b.weight"], heads=nh)
            stats = s["lse"] if run.flash else {int(n[1:]): t for n, t in s.items()
                                                if n[0] == "p" and n[1:].isdigit()}
            dq_h, acc = ring_backward(sp.head_group_ring(), codec, s["q_h"], s["own"], s["o_h"],
                                      stats, do_h, run.flash, run.block, run.overlap, scale)
            # The own block's gradient, home, back to the local tokens (the
            # all-to-alls' adjoints), then explicit's merge.
            dk_h, dv_h = codec.kv(acc, len(rows))
            dq = queries_back(dq_h)
            dk = move(dk_h, run.plans["k"], sp.group, sp.ledger, "backward", adjoint=True)
            dvv = move(dv_h, run.plans["v"], sp.group, sp.ledger, "backward", adjoint=True)
            d_chat, d_kpe, d_wkv = merge_heads(dk, dvv, s["c_hat"])
        elif spec.ring:
            codec = spec.codec(cfg, B, W["wkv_b.weight"])
            stats = s["lse"] if run.flash else {int(n[1:]): t for n, t in s.items()
                                                if n[0] == "p" and n[1:].isdigit()}
            dq, acc = ring_backward(sp, codec, s["q_h"], s["own"], s["o_loc"].view(B, L, H, dv),
                                    stats, do_h, run.flash, run.block, run.overlap, scale)
            # The own block's gradient, home, as d[c_hat | k_pe] and d wkv_b.
            d_chat, d_kpe, d_wkv = codec.latent_grad(acc, L, s.get("c_hat"))
            d_wkv = d_wkv.view(H, dn + dv, C)
        elif spec.keys is Keys.heads:  # explicit
            if run.flash:
                dq_h, dk_h, dv_h = flash_backward(s["q_h"], s["k_h"], s["v_h"], s["o_h"], s["lse"],
                                                  do_h, sp.key_ranges(rows, sp.layout.seq), scale,
                                                  run.block)
            else:
                dq_h, dk_h, dv_h = math_backward(s["q_h"], s["k_h"], s["v_h"], s["p0"], do_h,
                                                 scale, see=_mask_of(sp, rows, sp.layout.seq))
            dq = queries_back(dq_h)
            dk = move(dk_h, run.plans["k"], sp.group, sp.ledger, "backward", adjoint=True)
            dvv = move(dv_h, run.plans["v"], sp.group, sp.ledger, "backward", adjoint=True)
            d_chat, d_kpe, d_wkv = merge_heads(dk, dvv, s["c_hat"])
        elif tree is not None:  # absorbed, laga, laga_fused in the invariant mode
            dq_h, d_lat_h, d_w = _latent_backward_invariant(run, s, W, do_h)
            dq = queries_back(dq_h)
            d_wkv = invariant.gather_head_rows(d_w, sp.layout, sp.rank, sp.group, dn + dv,
                                               sp.ledger)
            # every head's part of the latent's gradient to the token's owner,
            # summed there over the heads in the tree (no rank-order reduce-scatter)
            d_loc = invariant.head_tree_sum(move(d_lat_h, sp.plan("head_to_seq", C + dr,
                                                                  "latent_heads"),
                                                 sp.group, sp.ledger, "backward"), 2)
            d_loc = d_loc.unsqueeze(2)
        else:  # the latent gathered: absorbed, laga, laga2d
            lat = s["lat"]
            d_lat = torch.zeros_like(lat)
            if form == "absorbed":
                w_uk, w_uv = wkv[h0:h0 + nh, :dn], wkv[h0:h0 + nh, dn:]
                do_lat = torch.einsum("bshv,hvc->bshc", do_h, w_uv)
                d_wkv[h0:h0 + nh, dn:] = torch.einsum("bshv,bshc->hvc", do_h, s["o_lat"])
                if run.flash:
                    dq_abs, dk_lat, dv_lat = flash_backward(
                        s["q_abs"], lat[:, :, None], s["v_lat"][:, :, None], s["o_lat"], s["lse"],
                        do_lat, sp.key_ranges(rows, sp.layout.seq), scale, run.block)
                else:
                    dq_abs, dk_lat, dv_lat = math_backward(s["q_abs"], lat[:, :, None],
                                                           s["v_lat"][:, :, None], s["p0"],
                                                           do_lat, scale,
                                                           see=_mask_of(sp, rows, sp.layout.seq))
                d_lat += dk_lat[:, :, 0]
                d_lat[..., :C] += dv_lat[:, :, 0]
                q_nope = s["q_h"][..., :dn]
                d_wkv[h0:h0 + nh, :dn] = torch.einsum("bshn,bshc->hnc", q_nope, dq_abs[..., :C])
                dq_h = torch.cat([torch.einsum("bshc,hnc->bshn", dq_abs[..., :C], w_uk),
                                  dq_abs[..., C:]], -1)
            else:
                Sk = run.key_end
                q_h = s["q_h"]
                w_r = wkv[h0:h0 + nh].reshape(-1, C)
                triton = "k_h" not in s and fused.kernel_for(
                    q_h, lat, w_r, do_h) is fused.FusedKernel.triton
                if "k_h" in s:
                    k_h, v_h = s["k_h"], s["v_h"]
                elif triton:  # laga_fused's Triton kernel makes K/V again a tile at a time
                    d_w = torch.zeros_like(w_r)
                    k_h = v_h = q_h.new_zeros(0)
                else:  # laga_fused: K/V made again from the latent (fused.py)
                    k_h, v_h = fused.up_project(lat[:, :Sk], w_r, cfg)
                dq_h, dk_h, dv_h = torch.zeros_like(q_h), torch.zeros_like(k_h), \
                    torch.zeros_like(v_h)
                for i, (a, b, e) in enumerate(run.calls):
                    if triton:
                        dq_h[:, a:b], d_lat_, d_w_ = fused.fused_triton.backward(
                            q_h[:, a:b], lat[:, :e], w_r, s["o_h"][:, a:b], s["lse"][:, :, a:b],
                            do_h[:, a:b], sp.key_ranges(rows[a:b], e), scale, cfg)
                        d_lat[:, :e] += d_lat_
                        d_w += d_w_
                        continue
                    if run.flash:
                        dq_, dk_, dv_ = flash_backward(
                            q_h[:, a:b], k_h[:, :e], v_h[:, :e], s["o_h"][:, a:b],
                            s["lse"][:, :, a:b], do_h[:, a:b], sp.key_ranges(rows[a:b], e), scale,
                            run.block)
                    else:
                        dq_, dk_, dv_ = math_backward(q_h[:, a:b], k_h[:, :e], v_h[:, :e],
                                                      s[f"p{i}"], do_h[:, a:b], scale,
                                                      see=_mask_of(sp, rows[a:b], e))
                    dq_h[:, a:b] = dq_
                    dk_h[:, :e] += dk_
                    dv_h[:, :e] += dv_
                if triton:
                    d_wkv[h0:h0 + nh] = d_w.view(nh, dn + dv, C)
                elif "k_h" not in s:  # laga_fused: the up-projection's adjoint (fused.py)
                    d_lat[:, :Sk], d_w = fused.up_project_backward(dk_h, dv_h, lat[:, :Sk], w_r,
                                                                   cfg)
                    d_wkv[h0:h0 + nh] = d_w.view(nh, dn + dv, C)
                else:
                    dkv = torch.cat([dk_h[..., :dn], dv_h], -1)  # (B, Sk, nh, dn+dv)
                    dkv = dkv.reshape(B, Sk, nh * (dn + dv))
                    d_lat[:, :Sk, :C] = dkv @ w_r
                    d_lat[:, :Sk, C:] = dk_h[..., dn:].sum(2)
                    d_wkv[h0:h0 + nh] = _mm_t(dkv, lat[:, :Sk, :C]).view(
                        nh, dn + dv, C)
            dq = queries_back(dq_h)
            if run.overlap:  # the latent's reduce-scatter on the wire during the query path's
                started = []
                flat = move(d_lat.unsqueeze(2), run.plans["lat"], sp.group, sp.ledger,
                            "backward", adjoint=True, started=started)
            else:
                d_loc = move(d_lat.unsqueeze(2), run.plans["lat"], sp.group, sp.ledger,
                             "backward", adjoint=True)
        G["wkv_b.weight"] = d_wkv.reshape(H * (dn + dv), C)

        # The local inputs' backward: the query path (RoPE rotated back, q_norm,
        # wq or wq_a and wq_b), then the latent path (kv_norm, wkv_a); dx.
        if not run.q_latent:
            dq = torch.cat([dq[..., :dn], _rot(dq[..., dn:], *trig, inverse=True)], -1)
            dq = dq.reshape(B, L, H * dqk)
        dw_sum = None if tree is None else tree.column_sum  # RMSNorm's weights
        if rq == 0:
            G["wq.weight"] = wgrad(dq, x)
            dx = mm(dq, W["wq.weight"])
        else:
            if run.q_latent:
                d_qn = dq
            else:
                G["wq_b.weight"] = wgrad(dq, s["qn"])
                d_qn = mm(dq, W["wq_b.weight"])
            d_qa, G["q_norm.weight"] = rms_backward(d_qn, s["qa"], W["q_norm.weight"],
                                                    cfg.norm_eps, dw_sum)
            G["wq_a.weight"] = wgrad(d_qa, x)
            dx = mm(d_qa, W["wq_a.weight"])
        if spec.keys is Keys.latent:
            if run.overlap and tree is None:
                started[0].wait()
                d_loc = _unpack_add(flat, run.plans["lat"].send, run.plans["lat"].src_shape)
            d_chat, d_kpe = d_loc[:, :, 0, :C], d_loc[:, :, 0, C:]
        kv_a = s["kv_a"]
        d_c, G["kv_norm.weight"] = rms_backward(d_chat, kv_a[..., :C], W["kv_norm.weight"],
                                                cfg.norm_eps, dw_sum)
        d_kva = torch.cat([d_c, _rot(d_kpe[:, :, None], *trig, inverse=True)[:, :, 0]], -1)
        G["wkv_a.weight"] = wgrad(d_kva, x)
        dx = dx + mm(d_kva, W["wkv_a.weight"])
        if d_gate is not None:  # the gate's logits g = x wg^T: dx += dg wg
            dx = dx + mm(d_gate, W["wg.weight"])
        return (dx, None) + tuple(G[n] for n in run.names)


def _latent_backward_invariant(run, s, W, do_h):
    """The invariant mode's backward of absorbed, laga and laga_fused's
    attention on the rank's heads (every token's rows): (dq_h, every head's
    part of the latent's gradient (B, S, nh, C + dr), the heads' rows of
    wkv_b's gradient (nh (dn + dv), C), each summed over the sequence in the
    chunk tree). One head at a time wherever laga sums over the rank's heads
    (the rank's number of heads changes with P)."""
    cfg, sp, rows = run.cfg, run.sp, run.rows
    H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
        cfg.qk_rope_head_dim, cfg.v_head_dim
    scale = cfg.softmax_scale()
    h0, nh = run.heads
    wkv = W["wkv_b.weight"].view(H, dn + dv, C)
    lat, q_h = s["lat"], s["q_h"]
    B, S = lat.shape[:2]
    tok = invariant.local_token_grad
    if run.form == "absorbed":
        w_uk, w_uv = wkv[h0:h0 + nh, :dn], wkv[h0:h0 + nh, dn:]
        dq_h, d_lat, d_w = [], [], []
        for i in range(nh):  # the shared latent head: its gradient per query head
            one = slice(i, i + 1)
            do_lat = (do_h[:, :, i] @ w_uv[i]).unsqueeze(2)
            if run.flash:
                dq_abs, dk_lat, dv_lat = flash_backward(
                    s["q_abs"][:, :, one], lat[:, :, None], s["v_lat"][:, :, None],
                    s["o_lat"][:, :, one], s["lse"][:, one], do_lat,
                    sp.key_ranges(rows, sp.layout.seq), scale, run.block)
            else:
                dq_abs, dk_lat, dv_lat = math_backward(
                    s["q_abs"][:, :, one], lat[:, :, None], s["v_lat"][:, :, None],
                    s["p0"][:, one], do_lat, scale, see=_mask_of(sp, rows, sp.layout.seq))
            dl = dk_lat[:, :, 0].clone()
            dl[..., :C] += dv_lat[:, :, 0]
            d_lat.append(dl)
            d_w.append(torch.cat([tok(q_h[:, :, i, :dn], dq_abs[:, :, 0, :C]),
                                  tok(do_h[:, :, i], s["o_lat"][:, :, i])]))
            dq_h.append(torch.cat([dq_abs[:, :, 0, :C] @ w_uk[i].t(), dq_abs[:, :, 0, C:]], -1))
    else:  # laga, laga_fused: K and V of the own heads (kept, or made again per head)
        Sk = run.key_end
        k_h, v_h = (s["k_h"], s["v_h"]) if "k_h" in s else \
            _up_heads(lat[:, :Sk], wkv[h0:h0 + nh], cfg)
        dq_all, dk_h, dv_h = torch.zeros_like(q_h), torch.zeros_like(k_h), torch.zeros_like(v_h)
        for i, (a, b, e) in enumerate(run.calls):
            if run.flash:
                dq_, dk_, dv_ = flash_backward(
                    q_h[:, a:b], k_h[:, :e], v_h[:, :e], s["o_h"][:, a:b], s["lse"][:, :, a:b],
                    do_h[:, a:b], sp.key_ranges(rows[a:b], e), scale, run.block)
            else:
                dq_, dk_, dv_ = math_backward(q_h[:, a:b], k_h[:, :e], v_h[:, :e], s[f"p{i}"],
                                              do_h[:, a:b], scale, see=_mask_of(sp, rows[a:b], e))
            dq_all[:, a:b] = dq_
            dk_h[:, :e] += dk_
            dv_h[:, :e] += dv_
        dq_h, d_lat, d_w = list(dq_all.unbind(2)), [], []
        for i in range(nh):
            dkv = torch.cat([dk_h[:, :, i, :dn], dv_h[:, :, i]], -1)  # (B, Sk, dn + dv)
            dl = lat.new_zeros(B, S, C + dr)
            dl[:, :Sk, :C] = dkv @ wkv[h0 + i]
            dl[:, :Sk, C:] = dk_h[:, :, i, dn:]
            d_lat.append(dl)
            d_w.append(tok(dkv, lat[:, :Sk, :C]))
    if not nh:
        return q_h.new_zeros(B, len(rows), 0, q_h.shape[-1]), lat.new_zeros(B, S, 0, C + dr), \
            lat.new_zeros(0, C)
    return torch.stack(dq_h, 2), torch.stack(d_lat, 2), torch.cat(d_w)


def _chunk_rows(c, S, device):
    """The global token rows of chunk c of the token tree (its last may be short)."""
    return torch.arange(c * invariant.CHUNK, min(c * invariant.CHUNK + invariant.CHUNK, S),
                        device=device)


def _gather_attend_invariant(run, q, k_h, v_h):
    """allgather_kv's attention in the invariant mode: o (B, L, H, dv) and
    (flash) lse (B, H, L) of the own rows, each computed in the call of its
    chunk of the global sequence (the chunk's rows, the ones this rank lacks
    zero; keys [0, the chunk's end)), the same call at every P."""
    sp, cfg = run.sp, run.cfg
    B, L, H, dqk = q.shape
    dv, S, scale = v_h.shape[-1], sp.layout.seq, cfg.softmax_scale()
    own = sp.own.tolist()
    at = {t: i for i, t in enumerate(own)}
    o = q.new_zeros(B, L, H, dv)
    lse = torch.zeros(B, H, L, dtype=_acc_dtype(q.dtype), device=q.device)
    for c in sorted({t // invariant.CHUNK for t in own}):
        rows = _chunk_rows(c, S, q.device)
        e = int(rows[-1]) + 1
        mine = [(i, at[t]) for i, t in enumerate(rows.tolist()) if t in at]
        blk = torch.tensor([i for i, _ in mine], dtype=torch.long, device=q.device)
        loc = torch.tensor([j for _, j in mine], dtype=torch.long, device=q.device)
        qb = q.new_zeros(B, len(rows), H, dqk)
        qb[:, blk] = q[:, loc]
        if run.flash:
            ob, lb = flash_forward(qb, k_h[:, :e], v_h[:, :e], sp.key_ranges(rows, e), scale,
                                   run.block)
            lse[:, :, loc] = lb[:, :, blk]
        else:
            ob, _ = math_forward(qb, k_h[:, :e], v_h[:, :e], sp.mask(rows, e), scale)
        o[:, loc] = ob[:, blk]
    return o, lse


def _gather_backward_invariant(run, s, do_h):
    """allgather_kv's attention backward in the invariant mode: (dK, dV) of
    the own tokens (B, L, H, .). Each chunk's rows (q, o, lse, dO) go whole
    to the chunk's owner, which runs the chunk's backward (eager: its
    probabilities recomputed by the forward's call); the chunks' dK, dV over
    the whole sequence are summed in the token tree on every rank (where
    the all-gathers' reduce-scatter summed the ranks in rank order), and dq
    goes back to the rows' ranks."""
    sp, cfg, tree = run.sp, run.cfg, run.tree
    q, k_h, v_h = s["q_h"], s["k_h"], s["v_h"]
    B, L, H, dqk = q.shape
    dv, S, scale, CH = v_h.shape[-1], sp.layout.seq, cfg.softmax_scale(), invariant.CHUNK
    parts = [q.reshape(B, L, H * dqk), s["o_loc"].reshape(B, L, H * dv),
             do_h.reshape(B, L, H * dv)]
    if run.flash:
        parts.append(s["lse"].transpose(1, 2).to(q.dtype))  # (B, L, H)
    dq_of = {}

    def leaf(c, qc, oc, doc, *lc):
        rows = _chunk_rows(c, S, q.device)
        n, e = len(rows), int(rows[-1]) + 1
        qb, ob = qc.view(B, CH, H, dqk)[:, :n], oc.view(B, CH, H, dv)[:, :n]
        dob = doc.view(B, CH, H, dv)[:, :n]
        if run.flash:
            lb = lc[0].view(B, CH, H)[:, :n].transpose(1, 2).to(s["lse"].dtype)
            dq_, dk_, dv_ = flash_backward(qb, k_h[:, :e], v_h[:, :e], ob, lb, dob,
                                           sp.key_ranges(rows, e), scale, run.block)
        else:
            _, p = math_forward(qb, k_h[:, :e], v_h[:, :e], sp.mask(rows, e), scale)
            dq_, dk_, dv_ = math_backward(qb, k_h[:, :e], v_h[:, :e], p, dob, scale,
                                          see=_mask_of(sp, rows, e))
        dq_of[c] = dq_.reshape(B, n, H * dqk)
        out = q.new_zeros(B, S, H, dqk + dv)
        out[:, :e, :, :dqk] = dk_
        out[:, :e, :, dqk:] = dv_
        return out

    dkv = tree.reduce(leaf, parts, (B, S, H, dqk + dv), "attention_tree")
    dq = tree.from_owners(dq_of, H * dqk, q, "attention_tree").view(B, L, H, dqk)
    own = dkv[:, sp.own]
    return own[..., :dqk], own[..., dqk:], dq
