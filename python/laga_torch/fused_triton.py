"""laga_fused in Triton: the up-projection made inside the attention kernel
(docs/pytorch_triton.md "laga_fused in Triton"; the C++ src/mla/form_laga_fused.cpp,
docs/forms.md "laga_fused"). fused.py is the plain-torch reference and the
fallback; fused.py's forward/backward call this module's when it is chosen
(fused.kernel_for).

Forward, one program per (query tile of BM rows, batch row, head):
  q (B, Sq, nh, dn+dr)   the rank's queries, read as q_nope | q_rope
  lat (B, Sk, C+dr)      the gathered latent [c | k_pe]
  w (nh (dn+dv), C)      the heads' rows of wkv_b: per head W_UK (dn, C), W_UV (dv, C)
  lo, hi (B, Sq)         the keys [lo, hi) each row sees (attention.KeyRanges)
  -> o (B, Sq, nh, dv), lse (B, nh, Sq)
For each key tile of BN keys the rows see, the program makes that tile's
k_nope = c W_UK^T (BN, dn) and v = c W_UV^T (BN, dv) on chip, C in chunks of
BC, and reads k_pe (BN, dr) as it is (every head's); scores are q_nope
k_nope^T + q_rope k_pe^T: 192 = 128 + 64 as two products, not one padded
to 256. Then the online softmax, as attention.flash_forward. K and V of the
whole sequence never exist.

Backward, one program per (key tile, batch row, head): the tile's k_nope, v
made again, then over the query tiles that see it (their range from lo/hi,
which are non-decreasing in the row) P = exp(s - lse), dv += P^T dO, dS =
P (dO v^T - D) scale, dk += dS^T q, and dq += dS k by atomic adds (fp32);
at the end the up-projection's adjoint: d c += dk_nope W_UK + dv W_UV and
d k_pe += dk_rope (atomic over heads), d W_UK += dk_nope^T c and d W_UV +=
dv^T c (atomic over key tiles and batch rows). D = rowsum(dO o) is one torch
reduction before the kernel. Atomic sums make the backward's float order
depend on scheduling on a GPU (not bitwise reproducible; the interpreter
runs programs in order).

Types: float32 and float64 operands compute in their own type (dots at
full "ieee" precision); bf16/fp16 operands make K and V in fp32 and, in
forward, round the tile to the operands' type for the two tensor-core
products (as FlashAttention does), where the C++ kernel keeps that tile
fp32: a bf16 Triton result is within bf16's bounds of the C++ one, not
equal to it; their backward computes in fp32 with tf32 dots (the bf16
operands convert exactly). lse, the softmax statistics and every gradient
sum are fp32 (fp64 for float64). Under TRITON_INTERPRET=1 (the CPU tests)
bf16 tl.dot is wrong (triton #11584): the tests run float32 and float64;
the bf16 path has been traced there (it runs) but its numbers have not been
checked anywhere.

Non-finite operands go to fused.py (kernel_for): this kernel multiplies a
masked p = 0 by v, so a NaN in another document's key would reach a row;
the torch path selects masked pairs out (attention._rows_times_keys).
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch 1.13 (Debian) has no triton; fused.py runs instead
    triton = None
    tl = None


def importable():
    return triton is not None


def interpreted():
    """Whether Triton runs its CPU interpreter (read by triton.jit when this
    module is imported, so set TRITON_INTERPRET=1 before importing laga_torch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _p2(n, least=16):
    """A power of two >= n (tl.arange's sizes), at least `least` (tl.dot's
    smallest operand side on a GPU)."""
    p = least
    while p < n:
        p *= 2
    return p


# Tile sizes: BM query rows, BN keys, BC latent columns per chunk. The
# interpreter runs 16s so that the tests' small S spans several tiles.
def _tiles(device):
    if device.type == "cuda":
        return 64, 64, 64
    return 16, 16, 16


if triton is not None:

    @triton.jit
    def _up_project(LAT, W, b, h, j, j_ok, sl_b, sl_s, C: tl.constexpr, DN: tl.constexpr,
                    DV: tl.constexpr, DNP: tl.constexpr, DVP: tl.constexpr, BN: tl.constexpr,
                    BC: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
        """k_nope (BN, DNP) and v (BN, DVP) of keys j for head h, in ACC."""
        dn = tl.arange(0, DNP)
        dv = tl.arange(0, DVP)
        k = tl.zeros((BN, DNP), dtype=ACC)
        v = tl.zeros((BN, DVP), dtype=ACC)
        wrow = h * (DN + DV)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            c_ok = cc < C
            lat = tl.load(LAT + b * sl_b + j[:, None] * sl_s + cc[None, :],
                          mask=j_ok[:, None] & c_ok[None, :], other=0.0).to(ACC)
            wk = tl.load(W + (wrow + dn[:, None]) * C + cc[None, :],
                         mask=(dn[:, None] < DN) & c_ok[None, :], other=0.0).to(ACC)
            wv = tl.load(W + (wrow + DN + dv[:, None]) * C + cc[None, :],
                         mask=(dv[:, None] < DV) & c_ok[None, :], other=0.0).to(ACC)
            k += tl.dot(lat, tl.trans(wk), input_precision=PREC, out_dtype=ACC)
            v += tl.dot(lat, tl.trans(wv), input_precision=PREC, out_dtype=ACC)
        return k, v

    @triton.jit
    def _fwd_kernel(Q, LAT, W, LO, HI, O, LSE, sq_b, sq_s, sq_h, sl_b, sl_s, so_b, so_s, so_h,
                    Sq, NH, scale, C: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
                    DV: tl.constexpr, DNP: tl.constexpr, DRP: tl.constexpr, DVP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr,
                    LOW: tl.constexpr, PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // NH
        h = pid_bh % NH
        rm = pid_m * BM + tl.arange(0, BM)
        r_ok = rm < Sq
        lo = tl.load(LO + b * Sq + rm, mask=r_ok, other=0)
        hi = tl.load(HI + b * Sq + rm, mask=r_ok, other=0)
        sees = lo < hi
        k_begin = tl.min(tl.where(sees, lo, 2147483647), axis=0)
        k_end = tl.max(tl.where(sees, hi, 0), axis=0)
        dn = tl.arange(0, DNP)
        dr = tl.arange(0, DRP)
        dv = tl.arange(0, DVP)
        qp = Q + b * sq_b + rm[:, None] * sq_s + h * sq_h
        q_nope = tl.load(qp + dn[None, :], mask=r_ok[:, None] & (dn[None, :] < DN), other=0.0)
        q_rope = tl.load(qp + DN + dr[None, :], mask=r_ok[:, None] & (dr[None, :] < DR),
                         other=0.0)
        if not LOW:
            q_nope = q_nope.to(ACC)
            q_rope = q_rope.to(ACC)
        m = tl.full((BM,), float("-inf"), dtype=ACC)
        l_sum = tl.zeros((BM,), dtype=ACC)
        acc = tl.zeros((BM, DVP), dtype=ACC)
        for j0 in range(k_begin, k_end, BN):
            j = j0 + tl.arange(0, BN)
            j_ok = j < k_end
            k_nope, v = _up_project(LAT, W, b, h, j, j_ok, sl_b, sl_s, C, DN, DV, DNP, DVP, BN,
                                    BC, ACC, PREC)
            k_pe = tl.load(LAT + b * sl_b + j[:, None] * sl_s + C + dr[None, :],
                           mask=j_ok[:, None] & (dr[None, :] < DR), other=0.0)
            if LOW:
                k_nope = k_nope.to(q_nope.dtype)
                v = v.to(q_nope.dtype)
            else:
                k_pe = k_pe.to(ACC)
            s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PREC, out_dtype=ACC)
            s += tl.dot(q_rope, tl.trans(k_pe), input_precision=PREC, out_dtype=ACC)
            s = s * scale
            see = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # A row that has seen no key yet has max -inf: shift by 0 (p = 0, not NaN).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.where(see, tl.exp(s - m_use[:, None]), 0.0)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if LOW:
                p = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC, out_dtype=ACC)
            m = m_new
        # A row that sees no key: o = 0 and lse = 0, as attention.flash_forward.
        ok = l_sum > 0
        l_safe = tl.where(ok, l_sum, 1.0)
        lse = tl.where(ok, m + tl.log(l_safe), 0.0)
        o = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
        tl.store(O + b * so_b + rm[:, None] * so_s + h * so_h + dv[None, :],
                 o.to(O.dtype.element_ty), mask=r_ok[:, None] & (dv[None, :] < DV))
        tl.store(LSE + (b * NH + h) * Sq + rm, lse, mask=r_ok)

    @triton.jit
    def _bwd_kernel(Q, LAT, W, LO, HI, DO, LSE, DEL, QB, QE, DQ, DLAT, DW, sq_b, sq_s, sq_h,
                    sl_b, sl_s, Sq, Sk, NH, NKB, scale, C: tl.constexpr, DN: tl.constexpr,
                    DR: tl.constexpr, DV: tl.constexpr, DNP: tl.constexpr, DRP: tl.constexpr,
                    DVP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                    ACC: tl.constexpr, LOW: tl.constexpr, PREC: tl.constexpr):
        # DO has q's strides with dv columns (made contiguous (B, Sq, nh, dv) by
        # the wrapper: sq_h / (dn+dr) * dv); DQ and DLAT are contiguous ACC
        # buffers shaped as q and lat; DW as w.
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // NH
        h = pid_bh % NH
        j = pid_n * BN + tl.arange(0, BN)
        j_ok = j < Sk
        dn = tl.arange(0, DNP)
        dr = tl.arange(0, DRP)
        dv = tl.arange(0, DVP)
        k_nope, v = _up_project(LAT, W, b, h, j, j_ok, sl_b, sl_s, C, DN, DV, DNP, DVP, BN, BC,
                                ACC, PREC)
        k_pe = tl.load(LAT + b * sl_b + j[:, None] * sl_s + C + dr[None, :],
                       mask=j_ok[:, None] & (dr[None, :] < DR), other=0.0).to(ACC)
        dk_nope = tl.zeros((BN, DNP), dtype=ACC)
        dk_pe = tl.zeros((BN, DRP), dtype=ACC)
        dv_acc = tl.zeros((BN, DVP), dtype=ACC)
        q_begin = tl.load(QB + b * NKB + pid_n)
        q_end = tl.load(QE + b * NKB + pid_n)
        DQK: tl.constexpr = DN + DR
        for a0 in range(q_begin, q_end, BM):
            rm = a0 + tl.arange(0, BM)
            r_ok = rm < q_end
            lo = tl.load(LO + b * Sq + rm, mask=r_ok, other=0)
            hi = tl.load(HI + b * Sq + rm, mask=r_ok, other=0)
            qp = Q + b * sq_b + rm[:, None] * sq_s + h * sq_h
            q_nope = tl.load(qp + dn[None, :], mask=r_ok[:, None] & (dn[None, :] < DN),
                             other=0.0).to(ACC)
            q_rope = tl.load(qp + DN + dr[None, :], mask=r_ok[:, None] & (dr[None, :] < DR),
                             other=0.0).to(ACC)
            do = tl.load(DO + ((b * Sq + rm[:, None]) * NH + h) * DV + dv[None, :],
                         mask=r_ok[:, None] & (dv[None, :] < DV), other=0.0).to(ACC)
            lse = tl.load(LSE + (b * NH + h) * Sq + rm, mask=r_ok, other=0.0)
            dlt = tl.load(DEL + (b * NH + h) * Sq + rm, mask=r_ok, other=0.0)
            s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PREC, out_dtype=ACC)
            s += tl.dot(q_rope, tl.trans(k_pe), input_precision=PREC, out_dtype=ACC)
            s = s * scale
            see = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None]) & r_ok[:, None]
            p = tl.where(see, tl.exp(s - lse[:, None]), 0.0)
            dv_acc += tl.dot(tl.trans(p), do, input_precision=PREC, out_dtype=ACC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)
            ds = tl.where(see, p * (dp - dlt[:, None]) * scale, 0.0)
            dk_nope += tl.dot(tl.trans(ds), q_nope, input_precision=PREC, out_dtype=ACC)
            dk_pe += tl.dot(tl.trans(ds), q_rope, input_precision=PREC, out_dtype=ACC)
            dq_nope = tl.dot(ds, k_nope, input_precision=PREC, out_dtype=ACC)
            dq_rope = tl.dot(ds, k_pe, input_precision=PREC, out_dtype=ACC)
            dqp = DQ + ((b * Sq + rm[:, None]) * NH + h) * DQK
            tl.atomic_add(dqp + dn[None, :], dq_nope, mask=r_ok[:, None] & (dn[None, :] < DN))
            tl.atomic_add(dqp + DN + dr[None, :], dq_rope,
                          mask=r_ok[:, None] & (dr[None, :] < DR))
        # The up-projection's adjoint for this key tile and head.
        dlp = DLAT + (b * Sk + j[:, None]) * (C + DR)
        tl.atomic_add(dlp + C + dr[None, :], dk_pe, mask=j_ok[:, None] & (dr[None, :] < DR))
        wrow = h * (DN + DV)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            c_ok = cc < C
            lat = tl.load(LAT + b * sl_b + j[:, None] * sl_s + cc[None, :],
                          mask=j_ok[:, None] & c_ok[None, :], other=0.0).to(ACC)
            wk = tl.load(W + (wrow + dn[:, None]) * C + cc[None, :],
                         mask=(dn[:, None] < DN) & c_ok[None, :], other=0.0).to(ACC)
            wv = tl.load(W + (wrow + DN + dv[:, None]) * C + cc[None, :],
                         mask=(dv[:, None] < DV) & c_ok[None, :], other=0.0).to(ACC)
            d_c = tl.dot(dk_nope, wk, input_precision=PREC, out_dtype=ACC)
            d_c += tl.dot(dv_acc, wv, input_precision=PREC, out_dtype=ACC)
            tl.atomic_add(dlp + cc[None, :], d_c, mask=j_ok[:, None] & c_ok[None, :])
            d_wk = tl.dot(tl.trans(dk_nope), lat, input_precision=PREC, out_dtype=ACC)
            d_wv = tl.dot(tl.trans(dv_acc), lat, input_precision=PREC, out_dtype=ACC)
            tl.atomic_add(DW + (wrow + dn[:, None]) * C + cc[None, :], d_wk,
                          mask=(dn[:, None] < DN) & c_ok[None, :])
            tl.atomic_add(DW + (wrow + DN + dv[:, None]) * C + cc[None, :], d_wv,
                          mask=(dv[:, None] < DV) & c_ok[None, :])


def _kinds(dtype):
    """(ACC, LOW, PREC, torch accumulation dtype) for operands of dtype."""
    if dtype == torch.float64:
        return tl.float64, False, "ieee", torch.float64
    if dtype == torch.float32:
        return tl.float32, False, "ieee", torch.float32
    return tl.float32, True, "tf32", torch.float32


def _dims(q, lat, w_rows, cfg):
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    nh = w_rows.shape[0] // (dn + dv)
    assert q.shape[3] == dn + dr and lat.shape[2] == C + dr and w_rows.shape[1] == C, \
        "fused_triton: q, lat, w_rows disagree with the config's head dims"
    return C, dn, dr, dv, nh


def forward(q, lat, w_rows, kr, scale, cfg):
    """o (B, Sq, nh, dv) in q's type and lse (B, nh, Sq) in the accumulation
    type, as fused.forward (which calls this when the Triton kernel is chosen)."""
    C, dn, dr, dv, nh = _dims(q, lat, w_rows, cfg)
    B, Sq = q.shape[:2]
    acc_t, low, prec, acc = _kinds(q.dtype)
    q, lat, w_rows = q.contiguous(), lat.contiguous(), w_rows.contiguous()
    o = q.new_empty(B, Sq, nh, dv)
    lse = torch.empty(B, nh, Sq, dtype=acc, device=q.device)
    if o.numel() == 0:
        return o.zero_(), lse.zero_()
    lo, hi = kr.lo.to(torch.int32).contiguous(), kr.hi.to(torch.int32).contiguous()
    BM, BN, BC = _tiles(q.device)
    _fwd_kernel[(triton.cdiv(Sq, BM), B * nh)](
        q, lat, w_rows, lo, hi, o, lse, q.stride(0), q.stride(1), q.stride(2), lat.stride(0),
        lat.stride(1), o.stride(0), o.stride(1), o.stride(2), Sq, nh, float(scale), C=C, DN=dn,
        DR=dr, DV=dv, DNP=_p2(dn), DRP=_p2(dr), DVP=_p2(dv), BM=BM, BN=BN, BC=BC, ACC=acc_t,
        LOW=low, PREC=prec)
    return o, lse


def backward(q, lat, w_rows, o, lse, do, kr, scale, cfg):
    """(dq, d lat, d w_rows) in their operands' types, as fused.backward."""
    C, dn, dr, dv, nh = _dims(q, lat, w_rows, cfg)
    B, Sq = q.shape[:2]
    Sk = lat.shape[1]
    acc_t, low, prec, acc = _kinds(q.dtype)
    q, lat, w_rows = q.contiguous(), lat.contiguous(), w_rows.contiguous()
    do = do.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    d_lat = torch.zeros(lat.shape, dtype=acc, device=q.device)
    d_w = torch.zeros(w_rows.shape, dtype=acc, device=q.device)
    if B == 0 or Sq == 0 or Sk == 0 or nh == 0:
        return dq.to(q.dtype), d_lat.to(lat.dtype), d_w.to(w_rows.dtype)
    delta = (do.to(acc) * o.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, nh, Sq)
    lse = lse.to(acc).contiguous()
    BM, BN, BC = _tiles(q.device)
    nkb = triton.cdiv(Sk, BN)
    # The query rows that see key tile [j0, j0 + BN): lo and hi are
    # non-decreasing in the row, so they are one range [first row with hi >
    # j0, first row with lo >= j0 + BN).
    j0 = torch.arange(nkb, device=q.device) * BN
    lo, hi = kr.lo.contiguous(), kr.hi.contiguous()
    q_begin = torch.searchsorted(hi, j0.expand(B, -1).contiguous(), right=True)
    q_end = torch.searchsorted(lo, (j0 + BN).expand(B, -1).contiguous(), right=False)
    q_begin, q_end = q_begin.to(torch.int32).contiguous(), q_end.to(torch.int32).contiguous()
    _bwd_kernel[(nkb, B * nh)](
        q, lat, w_rows, lo.to(torch.int32), hi.to(torch.int32), do, lse, delta, q_begin, q_end,
        dq, d_lat, d_w, q.stride(0), q.stride(1), q.stride(2), lat.stride(0), lat.stride(1), Sq,
        Sk, nh, nkb, float(scale), C=C, DN=dn, DR=dr, DV=dv, DNP=_p2(dn), DRP=_p2(dr),
        DVP=_p2(dv), BM=BM, BN=BN, BC=BC, ACC=acc_t, LOW=low, PREC=prec)
    return dq.to(q.dtype), d_lat.to(lat.dtype), d_w.to(w_rows.dtype)
