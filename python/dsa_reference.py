#!/usr/bin/python3
"""Independent PyTorch autograd reference for the MLA block with DeepSeek
Sparse Attention (DSA): forward, the LM backward through the selected keys,
and the lightning indexer's KL loss and its gradient (docs/forms.md,
"DeepSeek Sparse Attention (DSA)").

Written from the math (DeepSeek-V3.2's report §2.1 and its inference
model.py's Indexer), not from laga's C++: dense tensors, a dense Sq x Sk
index mask, autograd for every gradient. The MLA part reuses
torch_reference.py's pieces (rms_norm, rope, softmax_scale), which that
file's own test checks. float64 throughout; inputs drawn in float32 so the
C++ fp32 run reads the same values.

    /usr/bin/python3 python/dsa_reference.py --out DIR

writes DIR/dsa_<case>.safetensors: the config (ModelArgs names plus
index_n_heads, index_head_dim, index_topk; batch, seq, stage), the weights
(DeepSeek's names; the indexer's as indexer.*), x, dout, and the results:
out, dx, grad.<MLA weight> (LM loss), grad.indexer.* (KL loss), kl_loss,
idx (int32, each row's selection ascending, -1 after).

The top-k tie rule is laga's (kernels/dsa_indexer.hpp): a higher score
first, of equal scores the lower key position -- a stable descending sort.
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
import safetensors_io  # noqa: E402
import torch_reference as tr  # noqa: E402


@dataclasses.dataclass
class DsaConfig:
    dim: int = 32
    n_heads: int = 4
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    original_seq_len: int = 4096
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    norm_eps: float = 1e-6
    index_n_heads: int = 8
    index_head_dim: int = 16
    index_topk: int = 5
    batch: int = 2
    seq: int = 12
    stage: str = "sparse"  # or "dense_warmup"

    def to_json(self):
        return json.dumps(dataclasses.asdict(self))


CASES = {
    "sparse": DsaConfig(),
    # YaRN on (max_seq_len > original_seq_len) with mscale: the V3.2 setting.
    "sparse_yarn": DsaConfig(original_seq_len=8, max_seq_len=64, rope_factor=4.0, index_topk=4,
                             seq=10),
    "dense_warmup": DsaConfig(stage="dense_warmup"),
}


def indexer_shapes(cfg):
    return {
        "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk.weight": (cfg.index_head_dim, cfg.dim),
        "indexer.k_norm.weight": (cfg.index_head_dim,),
        "indexer.k_norm.bias": (cfg.index_head_dim,),
        "indexer.weights_proj.weight": (cfg.index_n_heads, cfg.dim),
    }


def rope_halves(x, cos, sin):
    """The indexer's RoPE: dim e paired with e + d/2 (DeepSeek's
    apply_rotary_emb(..., interleaved=False)). x [B, S, heads, d]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def stable_topk_mask(scores, k):
    """[B, S, T] bool: each row's k highest finite scores, ties to the lower
    position (a stable sort of the descending scores)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order))
    return (rank < k) & torch.isfinite(scores)


def dsa_block(p, x, cfg):
    """Returns out, kl_loss (autograd-connected as the report says), the
    selection mask [B, S, S]."""
    mla = tr.as_config(dataclasses.asdict(cfg))
    bsz, seq, _ = x.shape
    h, dn, dr, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    qr = tr.rms_norm(x @ p["wq_a.weight"].T, p["q_norm.weight"], cfg.norm_eps)
    q = (qr @ p["wq_b.weight"].T).view(bsz, seq, h, dn + dr)
    cos, sin = tr.rope_cos_sin(mla, seq, x.dtype)
    q = torch.cat([q[..., :dn], tr.apply_rope(q[..., dn:], cos, sin)], dim=-1)
    kv = x @ p["wkv_a.weight"].T
    c = tr.rms_norm(kv[..., :cfg.kv_lora_rank], p["kv_norm.weight"], cfg.norm_eps)
    k_pe = tr.apply_rope(kv[..., cfg.kv_lora_rank:].unsqueeze(2), cos, sin)
    kvb = (c @ p["wkv_b.weight"].T).view(bsz, seq, h, dn + dv)
    k = torch.cat([kvb[..., :dn], k_pe.expand(bsz, seq, h, dr)], dim=-1)
    v = kvb[..., dn:]

    # The indexer reads x and qr detached: only its KL trains it.
    xd, qrd = x.detach(), qr.detach()
    qi = (qrd @ p["indexer.wq_b.weight"].T).view(bsz, seq, hi, di)
    qi = torch.cat([rope_halves(qi[..., :dr], cos, sin), qi[..., dr:]], dim=-1)
    ki = torch.nn.functional.layer_norm(xd @ p["indexer.wk.weight"].T, (di,),
                                        p["indexer.k_norm.weight"], p["indexer.k_norm.bias"], 1e-6)
    ki = torch.cat([rope_halves(ki[..., :dr].unsqueeze(2), cos, sin).squeeze(2), ki[..., dr:]],
                   dim=-1)
    wi = (xd @ p["indexer.weights_proj.weight"].T) * hi ** -0.5 * di ** -0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    index = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * wi.unsqueeze(-1)).sum(dim=2)
    index = index.masked_fill(~causal, float("-inf"))
    selected = stable_topk_mask(index.detach(), cfg.index_topk)
    keys = selected if cfg.stage == "sparse" else causal.expand(bsz, seq, seq)

    scores = torch.einsum("bshd,bthd->bhst", q, k) * tr.softmax_scale(mla)
    probs = scores.masked_fill(~keys.unsqueeze(1), float("-inf")).softmax(dim=-1)
    o = torch.einsum("bhst,bthd->bshd", probs, v).reshape(bsz, seq, h * dv)
    out = o @ p["wo.weight"].T

    # KL(p || softmax(I)) over the key set, p the head-summed, L1-normalised
    # attention (a constant target).
    target = probs.detach().sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True)
    logq = index.masked_fill(~keys, float("-inf")).log_softmax(dim=-1)
    term = torch.where(target > 0, target * (target.clamp_min(1e-300).log() - logq),
                       torch.zeros_like(target))
    kl = term.masked_fill(~keys, 0.0).sum()
    return out, kl, selected


def run_case(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    p32 = tr.make_params(tr.as_config(dataclasses.asdict(cfg)), g)
    for name, shape in indexer_shapes(cfg).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if name == "indexer.k_norm.weight":
            p32[name] = 1.0 + 0.1 * w
        elif name == "indexer.k_norm.bias":
            p32[name] = 0.1 * w
        else:
            p32[name] = w / math.sqrt(shape[1])
    x32 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)
    dout32 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)
    p = {k: v.double().requires_grad_() for k, v in p32.items()}
    x = x32.double().requires_grad_()
    out, kl, selected = dsa_block(p, x, cfg)
    # The LM gradient and the KL gradient reach disjoint parameters (the
    # indexer's input is detached and the top-k has no gradient): one
    # backward of out . dout + kl gives each its own.
    ((out * dout32.double()).sum() + kl).backward()
    # The claim checked on fresh graphs: the LM loss reaches no indexer
    # weight, and the KL no MLA weight and not x.
    q = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
    xx = x.detach().clone().requires_grad_()
    out2, kl2, _ = dsa_block(q, xx, cfg)
    lm_grads = torch.autograd.grad((out2 * dout32.double()).sum(), list(q.values()) + [xx],
                                   allow_unused=True)
    kl_grads = torch.autograd.grad(kl2, list(q.values()) + [xx], allow_unused=True)
    for (name, g_lm), g_kl in zip(zip(list(q) + ["x"], lm_grads), kl_grads):
        if name.startswith("indexer."):
            assert g_lm is None or not g_lm.any(), f"the LM loss moved {name}"
        else:
            assert g_kl is None or not g_kl.any(), f"the KL loss moved {name}"
    idx = np.full((cfg.batch, cfg.seq, cfg.index_topk), -1, dtype=np.int32)
    sel = selected.numpy()
    for b in range(cfg.batch):
        for s in range(cfg.seq):
            js = np.nonzero(sel[b, s])[0]
            idx[b, s, :len(js)] = js
    inputs = dict(p32, x=x32, dout=dout32)
    results = {"out": out.detach(), "dx": x.grad}
    results.update({"grad." + k: v.grad for k, v in p.items()})
    results["kl_loss"] = kl.detach().reshape(1)
    return inputs, results, idx


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for seed, (name, cfg) in enumerate(CASES.items(), start=101):
        inputs, results, idx = run_case(cfg, seed)
        tensors = {k: v.numpy() for k, v in inputs.items()}
        tensors.update({k: v.numpy() for k, v in results.items()})  # float64
        tensors["idx"] = idx
        meta = {"config": cfg.to_json(), "case": name, "seed": str(seed),
                "producer": "python/dsa_reference.py (torch %s, float64)" % torch.__version__}
        path = os.path.join(args.out, f"dsa_{name}.safetensors")
        safetensors_io.save_file(tensors, path, meta)
        print(f"{path}: kl_loss {results['kl_loss'].item():.6f}, "
              f"{int((idx >= 0).sum())} selected keys")


if __name__ == "__main__":
    main()
