#!/usr/bin/python3
"""DeepSeek's fp8 indexer path, as a harness for laga's index_fp8 option.

Extends python/dsa_deepseek_harness.py (our transcription of
deepseek-ai/DeepSeek-V3.2-Exp inference/model.py after 8631a81 "fix indexer
rope") with the parts that harness replaces by plain math, as DeepSeek's
Indexer.forward and inference/kernel.py compute them:
  - rotate_activation: fast_hadamard_transform's hadamard_transform(x,
    scale=d^-1/2); here the dense Sylvester matrix H_d (Kronecker powers of
    [[1, 1], [1, -1]]) times x, in float64 (laga uses the fast transform);
  - act_quant(x, 128, scale_fmt="ue8m0") (V3.2's config sets scale_fmt
    ue8m0): per block of 128, amax = max(|x|, 1e-4), s = amax * fp32(1/448),
    s = 2^ceil(log2 s) (kernel.py's fast_round_scale), y = cast_e4m3(clamp(x
    / s, -448, 448)), in fp32. The cast is torch.float8_e4m3fn where this
    torch has it (torch 2; its own round-to-nearest-even conversion, not
    laga's code), else an emulation in numpy (round half to even of x on
    the e4m3 grid of x's binade, np.round); the run prints which;
  - fp8_index: fp32 logits q' . k' (torch's fp32 einsum of the e4m3
    values), ReLU, times weights * q_scale, summed over heads in fp32,
    times k_scale; topk as DeepSeek's.
  - MLA.forward's fp8 simulation of the kv cache: act_quant(kv) of the
    latent after kv_norm and back (values times scales), in fp32.
Left as the plain harness has them: float64 elsewhere (where DeepSeek has
bf16: the rotated q, k and the round-tripped latent are fp32, not bf16).

It writes its own case (index_head_dim 128: DeepSeek's fp8_index takes one
k scale per key, so its code runs only where the indexer's head is one
block; kv_lora_rank 128 for the kv simulation's blocks):

    /usr/bin/python3 python/dsa_deepseek_fp8.py --out DIR

writes DIR/dsa_fp8.safetensors: the config (ModelArgs names, index_*,
index_fp8 and kv_fp8_round_trip true, batch, seq), the weights, x, and
DeepSeek's results: deepseek_topk (int64, [B, S, min(index_topk, S)]),
deepseek_out (float64, [B, S, D]; the whole fp8 path) and
deepseek_out_indexer_only (the kv-cache simulation off). A row whose k-th and (k+1)-th fp8 scores are within
1e-5 relative is refused (exit non-zero): there fp32 rounding order (theirs
on tensor cores, ours in torch, laga's in double) could pick either key.
mla_test_dsa_fp8_deepseek compares laga with it.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsa_deepseek_harness as dh  # noqa: E402
import dsa_reference as dr  # noqa: E402
import safetensors_io  # noqa: E402
import torch_reference as tr  # noqa: E402

BLOCK = 128
FP8_MAX = 448.0
HAVE_TORCH_FP8 = hasattr(torch, "float8_e4m3fn")


def hadamard(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == d, f"rotate_activation needs a power of two, got {d}"
    return h


def rotate_activation(x):
    d = x.shape[-1]
    return x @ hadamard(d).T * d ** -0.5


def cast_e4m3_emulated(v):
    """Round fp32 values (|v| <= 448) to e4m3, ties to even, in numpy."""
    a = np.abs(v.numpy().astype(np.float64))
    _, e = np.frexp(a)  # a in [2^(e-1), 2^e)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    r = np.minimum(np.round(a / step) * step, FP8_MAX)  # np.round: half to even
    return torch.from_numpy(np.copysign(r, v.numpy()).astype(np.float32))


def cast_e4m3(v):
    if HAVE_TORCH_FP8:
        return v.to(torch.float8_e4m3fn).to(torch.float32)
    return cast_e4m3_emulated(v)


def act_quant(x, block_size=BLOCK, scale_fmt="ue8m0"):
    """kernel.py's act_quant: the e4m3 values (as fp32) and fp32 scales."""
    x = x.to(torch.float32)
    shape = x.shape
    assert shape[-1] % block_size == 0
    xb = x.reshape(-1, block_size)
    amax = xb.abs().amax(dim=-1).clamp_min(1e-4)
    s = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    if scale_fmt is not None:  # fast_round_scale: 2^(exponent + (mantissa != 0))
        m, e = torch.frexp(s)  # s = m 2^e, m in [0.5, 1)
        s = torch.ldexp(torch.ones_like(s), (e - (m == 0.5).to(e.dtype)).to(torch.float32))
    y = cast_e4m3((xb / s[:, None]).clamp(-FP8_MAX, FP8_MAX))
    return y.reshape(shape), s.reshape(*shape[:-1], shape[-1] // block_size)


def fp8_index(q, q_s, k, k_s):
    """kernel.py's fp8_index: q (b,m,h,d), q_s (b,m,h), k (b,n,d), k_s (b,n)."""
    logits = torch.einsum("bmhd,bnd->bmnh", q, k)  # fp32
    return (logits.clamp_min(0) * q_s[:, :, None, :]).sum(dim=-1) * k_s[:, None, :]


def indexer_forward_fp8(w, args, x, qr, freqs_cis, mask):
    bsz, seqlen, _ = x.size()
    n_heads, head_dim, rope_head_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
    q = (qr @ w["indexer.wq_b.weight"].T).view(bsz, seqlen, n_heads, head_dim)
    q_pe, q_nope = torch.split(q, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    q = torch.cat([dh.apply_rotary_emb(q_pe, freqs_cis, False), q_nope], dim=-1)
    k = dh.layer_norm(x @ w["indexer.wk.weight"].T, w["indexer.k_norm.weight"],
                      w["indexer.k_norm.bias"])
    k_pe, k_nope = torch.split(k, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    k = torch.cat([dh.apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, False).squeeze(2), k_nope],
                  dim=-1)
    q = rotate_activation(q)
    k = rotate_activation(k)
    q_fp8, q_scale = act_quant(q)
    k_fp8, k_scale = act_quant(k)
    weights = (x @ w["indexer.weights_proj.weight"].T) * n_heads ** -0.5 * head_dim ** -0.5
    weights = weights.to(torch.float32) * q_scale[..., 0]
    index_score = fp8_index(q_fp8, weights, k_fp8, k_scale[..., 0]).double()
    index_score += mask
    topk_indices = index_score.topk(min(args.index_topk, seqlen), dim=-1)[1]
    return topk_indices, index_score


def mla_forward_fp8(w, args, x, freqs_cis, mask, kv_fp8_simulation):
    """dsa_deepseek_harness.mla_forward with the fp8 indexer (and, when
    asked, MLA.forward's kv-cache fp8 simulation)."""
    bsz, seqlen, _ = x.size()
    n_heads = args.n_heads
    qk_nope, qk_rope, v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    softmax_scale = (qk_nope + qk_rope) ** -0.5
    if args.max_seq_len > args.original_seq_len:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        softmax_scale = softmax_scale * mscale * mscale
    qr = dh.rms_norm(x @ w["wq_a.weight"].T, w["q_norm.weight"])
    q = (qr @ w["wq_b.weight"].T).view(bsz, seqlen, n_heads, qk_nope + qk_rope)
    q_nope, q_pe = torch.split(q, [qk_nope, qk_rope], dim=-1)
    q_pe = dh.apply_rotary_emb(q_pe, freqs_cis)
    kv = x @ w["wkv_a.weight"].T
    kv, k_pe = torch.split(kv, [args.kv_lora_rank, qk_rope], dim=-1)
    kv = dh.rms_norm(kv, w["kv_norm.weight"])
    k_pe = dh.apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
    if kv_fp8_simulation:  # "we use fp8 kv cache in actual deployment ..."
        kv_fp8, kv_scale = act_quant(kv)
        kv = (kv_fp8.view(-1, BLOCK) * kv_scale.view(-1, 1)).double().view_as(kv)
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv = (kv @ w["wkv_b.weight"].T).view(bsz, seqlen, n_heads, qk_nope + v_dim)
    k_nope, v = torch.split(kv, [qk_nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, n_heads, -1)], dim=-1)
    scores = torch.einsum("bshd,bthd->bsht", q, k).mul_(softmax_scale)
    topk_indices, index_score = indexer_forward_fp8(w, args, x, qr, freqs_cis, mask)
    index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter_(-1, topk_indices, 0)
    index_mask += mask
    scores = (scores + index_mask.unsqueeze(2)).softmax(dim=-1)
    x = torch.einsum("bsht,bthd->bshd", scores, v)
    return x.flatten(2) @ w["wo.weight"].T, topk_indices, index_score


def near_ties(index_score, k, rel=1e-5):
    """Rows whose k-th and (k+1)-th finite scores are within rel of each other."""
    n = 0
    for row in index_score.reshape(-1, index_score.shape[-1]):
        finite = row[torch.isfinite(row)].sort(descending=True).values
        if len(finite) > k and abs(finite[k - 1] - finite[k]) <= rel * abs(finite[0]):
            n += 1
    return n


def self_check():
    """The two casts agree where torch has fp8; the rotation is orthogonal."""
    v = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 60,
                   torch.tensor([1.0625, 1.1875, 2.0 ** -10, 447.9, -448.0, 0.0])]).float()
    v = v.clamp(-FP8_MAX, FP8_MAX)
    emu = cast_e4m3_emulated(v)
    assert emu[-6:].tolist() == [1.0, 1.25, 0.0, 448.0, -448.0, 0.0], emu[-6:]
    if HAVE_TORCH_FP8:
        assert torch.equal(emu, v.to(torch.float8_e4m3fn).float()), "emulation != torch's cast"
    h = hadamard(BLOCK) * BLOCK ** -0.5
    assert torch.allclose(h @ h, torch.eye(BLOCK, dtype=torch.float64), atol=1e-13)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    self_check()
    cfg = dr.DsaConfig(kv_lora_rank=128, index_n_heads=4, index_head_dim=128, index_topk=6,
                       batch=2, seq=20)
    g = torch.Generator().manual_seed(2055)
    p32 = tr.make_params(tr.as_config(dataclasses.asdict(cfg)), g)
    for name, shape in dr.indexer_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        p32[name] = (1.0 + 0.1 * t if name == "indexer.k_norm.weight" else
                     0.1 * t if name == "indexer.k_norm.bias" else t / math.sqrt(shape[1]))
    x32 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)
    w = {k: v.double() for k, v in p32.items()}
    args = dataclasses.replace(cfg)
    freqs_cis = dh.precompute_freqs_cis(args)[:cfg.seq]
    mask = torch.full((cfg.seq, cfg.seq), float("-inf")).triu_(1)
    x = x32.double()
    out, topk, score = mla_forward_fp8(w, args, x, freqs_cis, mask, False)
    out_kv, topk_kv, _ = mla_forward_fp8(w, args, x, freqs_cis, mask, True)
    assert torch.equal(topk, topk_kv)
    ties = near_ties(score, cfg.index_topk)
    if ties:
        sys.exit(f"{ties} rows have fp8 scores within 1e-5 at the top-k boundary: change the seed")
    plain_out, plain_topk, _ = dh.mla_forward(w, args, x, 0, freqs_cis, mask)
    moved = sum(set(a.tolist()) != set(b.tolist())
                for a, b in zip(topk.reshape(-1, topk.shape[-1]),
                                plain_topk.reshape(-1, plain_topk.shape[-1])))
    config = dict(dataclasses.asdict(cfg), index_fp8=True, kv_fp8_round_trip=True)
    tensors = {k: v.numpy() for k, v in p32.items()}
    tensors.update(x=x32.numpy(), deepseek_topk=topk.numpy().astype(np.int64),
                   deepseek_out=out_kv.numpy(), deepseek_out_indexer_only=out.numpy())
    cast = "torch.float8_e4m3fn" if HAVE_TORCH_FP8 else "numpy emulation"
    path = os.path.join(a.out, "dsa_fp8.safetensors")
    safetensors_io.save_file(tensors, path, {
        "config": json.dumps(config),
        "producer": f"python/dsa_deepseek_fp8.py: DeepSeek-V3.2-Exp fp8 indexer (e4m3 cast: {cast}, "
                    f"torch {torch.__version__})"})
    print(f"{path}: e4m3 cast by {cast} (torch {torch.__version__}); fp8 selection differs from "
          f"the unquantized one in {moved} of {cfg.batch * cfg.seq} rows; the kv-cache fp8 "
          f"simulation moves the output by "
          f"{(out_kv - out).abs().max().item():.3g} (|out| max {out.abs().max().item():.3g})")


if __name__ == "__main__":
    main()
