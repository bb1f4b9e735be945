#!/usr/bin/python3
"""DeepSeek's own DSA prefill math, as a harness for laga's DSA block.

Reproduces, function by function, deepseek-ai/DeepSeek-V3.2-Exp
inference/model.py as it stands after commit 8631a81 "fix indexer rope"
(2025-11-17), which made the indexer's RoPE non-interleaved
(apply_rotary_emb(..., interleaved=False)): precompute_freqs_cis,
apply_rotary_emb, RMSNorm, LayerNorm, Indexer.forward and MLA.forward's
prefill branch (mask given), on the weights and inputs of a case that
python/dsa_reference.py wrote. Their file is not vendored; this is our
transcription of its math, with what needs a GPU or fp8 replaced by plain
math, each replacement named where it is made:
  - rotate_activation (a Hadamard transform scaled by d^-1/2, orthogonal)
    is left out: without quantization q.k is unchanged by it;
  - act_quant / fp8_index become float64 einsums: fp8_index computes
    sum_h relu(q_h . k) * weights_h * k_scale, and with no quantization
    q_scale = k_scale = 1;
  - MLA.forward's fp8 simulation of the kv cache (act_quant of kv and back)
    is left out, as is the decode branch and the k/kv caches;
  - everything runs in float64 (their Linear is bf16 or fp8).
torch.topk's choice among equal scores is unspecified, so the harness
refuses (exits non-zero) a case whose scores tie at a row's top-k boundary:
there the selection is not DeepSeek's to define (laga's rule picks the
lower position).

    /usr/bin/python3 python/dsa_deepseek_harness.py --dir DIR

reads DIR/dsa_<case>.safetensors for the sparse cases and writes
DIR/dsa_<case>_deepseek.safetensors: deepseek_topk (int64, [B, S,
min(index_topk, S)], torch.topk's indices, masked ones included as
DeepSeek's code has them) and deepseek_out (float64, [B, S, D]).
"""

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

SPARSE_CASES = ("sparse", "sparse_yarn")


def precompute_freqs_cis(args):
    dim = args.qk_rope_head_dim
    seqlen = args.max_seq_len
    beta_fast, beta_slow = args.beta_fast, args.beta_slow
    base, factor = args.rope_theta, args.rope_factor

    def find_correction_dim(num_rotations, dim, base, max_seq_len):
        return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
        low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
        high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001
        linear_func = (torch.arange(dim, dtype=torch.float64) - min) / (max - min)
        return torch.clamp(linear_func, 0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if seqlen > args.original_seq_len:
        low, high = find_correction_range(beta_fast, beta_slow, dim, base, args.original_seq_len)
        smooth = 1 - linear_ramp_factor(low, high, dim // 2)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    t = torch.arange(seqlen, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis, interleaved=True):
    dtype = x.dtype
    shape = x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    x = torch.view_as_complex(x.double().view(*shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y.to(dtype)


def rms_norm(x, weight, eps=1e-6):
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def layer_norm(x, weight, bias, eps=1e-6):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def indexer_forward(w, args, x, qr, start_pos, freqs_cis, mask):
    bsz, seqlen, _ = x.size()
    end_pos = start_pos + seqlen
    n_heads, head_dim, rope_head_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
    softmax_scale = head_dim ** -0.5
    q = qr @ w["indexer.wq_b.weight"].T
    q = q.view(bsz, seqlen, n_heads, head_dim)
    q_pe, q_nope = torch.split(q, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    q_pe = apply_rotary_emb(q_pe, freqs_cis, False)  # rope in indexer is not interleaved
    q = torch.cat([q_pe, q_nope], dim=-1)
    k = x @ w["indexer.wk.weight"].T
    k = layer_norm(k, w["indexer.k_norm.weight"], w["indexer.k_norm.bias"])
    k_pe, k_nope = torch.split(k, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, False).squeeze(2)
    k = torch.cat([k_pe, k_nope], dim=-1)
    # rotate_activation(q), rotate_activation(k): orthogonal, left out.
    weights = (x @ w["indexer.weights_proj.weight"].T) * n_heads ** -0.5
    weights = weights.unsqueeze(-1) * softmax_scale  # q_scale = 1 without fp8
    # fp8_index(q, weights, k, k_scale) without quantization:
    logits = torch.einsum("bmhd,bnd->bmnh", q, k)
    index_score = (logits.clamp_min(0) * weights[:, :, None, :, 0]).sum(dim=-1)
    if mask is not None:
        index_score += mask
    topk_indices = index_score.topk(min(args.index_topk, end_pos), dim=-1)[1]
    return topk_indices, index_score


def mla_forward(w, args, x, start_pos, freqs_cis, mask):
    bsz, seqlen, _ = x.size()
    n_heads = args.n_heads
    qk_nope, qk_rope, v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    qk_head_dim = qk_nope + qk_rope
    softmax_scale = qk_head_dim ** -0.5
    if args.max_seq_len > args.original_seq_len:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        softmax_scale = softmax_scale * mscale * mscale
    qr = rms_norm(x @ w["wq_a.weight"].T, w["q_norm.weight"])
    q = (qr @ w["wq_b.weight"].T).view(bsz, seqlen, n_heads, qk_head_dim)
    q_nope, q_pe = torch.split(q, [qk_nope, qk_rope], dim=-1)
    q_pe = apply_rotary_emb(q_pe, freqs_cis)
    kv = x @ w["wkv_a.weight"].T
    kv, k_pe = torch.split(kv, [args.kv_lora_rank, qk_rope], dim=-1)
    kv = rms_norm(kv, w["kv_norm.weight"])
    k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
    # (the fp8 simulation of the kv cache is left out)
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv = (kv @ w["wkv_b.weight"].T).view(bsz, seqlen, n_heads, qk_nope + v_dim)
    k_nope, v = torch.split(kv, [qk_nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, n_heads, -1)], dim=-1)
    scores = torch.einsum("bshd,bthd->bsht", q, k).mul_(softmax_scale)
    topk_indices, index_score = indexer_forward(w, args, x, qr, start_pos, freqs_cis, mask)
    index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter_(-1, topk_indices, 0)
    index_mask += mask
    scores += index_mask.unsqueeze(2)
    scores = scores.softmax(dim=-1)
    x = torch.einsum("bsht,bthd->bshd", scores, v)
    return x.flatten(2) @ w["wo.weight"].T, topk_indices, index_score


def boundary_ties(index_score, k):
    """Rows whose k-th and (k+1)-th finite scores are equal."""
    ties = 0
    for row in index_score.reshape(-1, index_score.shape[-1]):
        finite = row[torch.isfinite(row)].sort(descending=True).values
        if len(finite) > k and finite[k - 1] == finite[k]:
            ties += 1
    return ties


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    for name in SPARSE_CASES:
        path = os.path.join(a.dir, f"dsa_{name}.safetensors")
        tensors, meta = safetensors_io.load_file(path)
        args = SimpleNamespace(**json.loads(meta["config"]))
        w = {k: torch.from_numpy(np.asarray(v)).double() for k, v in tensors.items()}
        seqlen = args.seq
        args.max_seq_len = max(args.max_seq_len, seqlen)
        freqs_cis = precompute_freqs_cis(args)[:seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf")).triu_(1)
        out, topk, score = mla_forward(w, args, w["x"], 0, freqs_cis, mask)
        ties = boundary_ties(score, args.index_topk)
        if ties:
            sys.exit(f"{path}: {ties} rows tie at the top-k boundary; torch.topk's choice there "
                     "is unspecified, so this case cannot compare selections: change its seed")
        out_path = os.path.join(a.dir, f"dsa_{name}_deepseek.safetensors")
        safetensors_io.save_file(
            {"deepseek_topk": topk.numpy().astype(np.int64), "deepseek_out": out.numpy()},
            out_path,
            {"producer": "python/dsa_deepseek_harness.py: DeepSeek-V3.2-Exp inference/model.py "
                         "after 8631a81 (fix indexer rope), float64, no fp8"})
        gap = (out - w["out"]).abs().max().item()
        print(f"{out_path}: |DeepSeek out - dsa_reference out| max {gap:.3g}")


if __name__ == "__main__":
    main()
