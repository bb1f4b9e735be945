#!/usr/bin/python3
"""Independent PyTorch reference for Kimi K3's gated NoPE MLA, in float64.

A reimplementation, written for laga's tests, of the attention of Kimi's MLA
layers as Kimi's own code defines it (Hugging Face's modeling_kimi_linear.py
KimiMLAAttention and torchtitan's kimi_k3 attention: the same math):

    q        = q_b_proj(q_a_layernorm(q_a_proj(h)))     (or q_proj(h) without
               a query latent), viewed (B, S, H, dn + dr), split [q_nope | q_pe]
    kv_a     = kv_a_proj_with_mqa(h) = [compressed_kv (C) | k_pe (dr)]
    kv       = kv_b_proj(kv_a_layernorm(compressed_kv)) -> [k_nope | value] per head
    mla_use_nope: q_pe and k_pe are NOT rotated; k_pe (one per token) is
               expanded over the heads, MQA-style
    scores   = [q_nope | q_pe] . [k_nope | k_pe] * (dn + dr)^-1/2, causal
    attn     = softmax(scores) value, reshaped (B, S, H dv)
    mla_use_output_gate: attn = attn * sigmoid(g_proj(h))   (full rank,
               channel-wise, BEFORE o_proj)
    out      = o_proj(attn)

Weights under Kimi's (Hugging Face) names, model.layers.0.self_attn.<name>;
the config under Kimi's config.json keys (hidden_size, num_attention_heads,
..., mla_use_nope, mla_use_output_gate). Kimi's RMSNorm upcasts to float32
and back; in float64 that cast would lose precision, so the norms here
compute in the input's dtype (float64), which is what "upcast" means for a
float64 input. The norms' eps is 1e-6: Kimi builds q_a_layernorm and
kv_a_layernorm without an eps argument, taking its RMSNorm's default.

Usage (Debian's python, torch 1.13):

    /usr/bin/python3 python/kimi_reference.py --out DIR [--check]

writes DIR/case_<name>.safetensors (F64: the weights, x, dout, out, dx and
grad.<weight>) for every case in CASES; --check also runs
torch.autograd.gradcheck on a tiny case. tests/mla/test_kimi_reference.cpp
runs every laga form in double on each file.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402  (sibling module, path set just above)

PREFIX = "model.layers.0.self_attn."
NORM_EPS = 1e-6


def weight_shapes(cfg):
    """Kimi's attention weights (Hugging Face names) -> shape [out, in]."""
    h, d = cfg["num_attention_heads"], cfg["hidden_size"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    c, rq = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    shapes = {}
    if rq is None:
        shapes["q_proj.weight"] = (h * (dn + dr), d)
    else:
        shapes["q_a_proj.weight"] = (rq, d)
        shapes["q_a_layernorm.weight"] = (rq,)
        shapes["q_b_proj.weight"] = (h * (dn + dr), rq)
    shapes["kv_a_proj_with_mqa.weight"] = (c + dr, d)
    shapes["kv_a_layernorm.weight"] = (c,)
    shapes["kv_b_proj.weight"] = (h * (dn + dv), c)
    shapes["o_proj.weight"] = (d, h * dv)
    if cfg.get("mla_use_output_gate"):
        shapes["g_proj.weight"] = (h * dv, d)
    return shapes


def rms_norm(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS))


def kimi_mla(w, hidden, cfg):
    """Kimi's MLA attention: hidden (B, S, D) -> (B, S, D). w: name -> tensor."""
    if not cfg.get("mla_use_nope"):
        raise ValueError("this reference is Kimi's NoPE MLA: set mla_use_nope true")
    bsz, seq, _ = hidden.shape
    h = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    c = cfg["kv_lora_rank"]
    if cfg["q_lora_rank"] is None:
        q = hidden @ w["q_proj.weight"].T
    else:
        q = rms_norm(hidden @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
        q = q @ w["q_b_proj.weight"].T
    q = q.view(bsz, seq, h, dn + dr).transpose(1, 2)            # (B, H, S, dn + dr)
    kv_a = hidden @ w["kv_a_proj_with_mqa.weight"].T
    compressed_kv, k_pe = torch.split(kv_a, [c, dr], dim=-1)
    k_pe = k_pe.view(bsz, seq, 1, dr).transpose(1, 2)          # (B, 1, S, dr)
    kv = rms_norm(compressed_kv, w["kv_a_layernorm.weight"]) @ w["kv_b_proj.weight"].T
    kv = kv.view(bsz, seq, h, dn + dv).transpose(1, 2)
    k_nope, value = torch.split(kv, [dn, dv], dim=-1)
    # mla_use_nope: no rotary embedding on q_pe or k_pe.
    key = torch.cat([k_nope, k_pe.expand(bsz, h, seq, dr)], dim=-1)
    scores = (q @ key.transpose(-1, -2)) * (dn + dr) ** -0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    attn = (probs @ value).transpose(1, 2).reshape(bsz, seq, h * dv)
    if cfg.get("mla_use_output_gate"):
        attn = attn * torch.sigmoid(hidden @ w["g_proj.weight"].T)
    return attn @ w["o_proj.weight"].T


def kimi_config(dim, heads, rq, c, dn, dr, dv, gate=True, **extra):
    cfg = {"model_type": "kimi_linear", "hidden_size": dim, "num_attention_heads": heads,
           "num_key_value_heads": heads, "q_lora_rank": rq, "kv_lora_rank": c,
           "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv,
           "mla_use_nope": True, "mla_use_output_gate": gate, "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 4096}
    cfg.update(extra)
    return cfg


# Kimi K3's MLA in miniature (query latent, unrotated dr, the gate), its
# dr = 0 variant without a query latent, odd heads, and one without the gate.
CASES = {
    "k3_like": (kimi_config(40, 5, 12, 16, 8, 4, 6), 2, 13),
    "rope0_rq0": (kimi_config(24, 3, None, 12, 6, 0, 5), 2, 11),
    "nogate": (kimi_config(24, 3, 10, 12, 6, 4, 4, gate=False), 1, 9),
}


def run_case(cfg, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            w[name] = 1.0 + 0.1 * torch.randn(*shape, generator=g, dtype=torch.float64)
        else:
            w[name] = torch.randn(*shape, generator=g, dtype=torch.float64) * shape[1] ** -0.5
    x = torch.randn(batch, seq, cfg["hidden_size"], generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, cfg["hidden_size"], generator=g, dtype=torch.float64)
    params = {k: v.clone().requires_grad_() for k, v in w.items()}
    xg = x.clone().requires_grad_()
    out = kimi_mla(params, xg, cfg)
    out.backward(dout)
    tensors = {PREFIX + k: v for k, v in w.items()}
    tensors.update({"x": x, "dout": dout, "out": out.detach(), "dx": xg.grad})
    tensors.update({"grad." + PREFIX + k: v.grad for k, v in params.items()})
    return tensors


def gradcheck():
    cfg = kimi_config(6, 2, 5, 4, 2, 2, 3)
    g = torch.Generator().manual_seed(7)
    shapes = weight_shapes(cfg)
    names = list(shapes)
    ws = [(1.0 + 0.1 * torch.randn(*s, generator=g, dtype=torch.float64)) if len(s) == 1
          else torch.randn(*s, generator=g, dtype=torch.float64) * 0.5 for s in shapes.values()]
    x = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)

    def f(x_, *ws_):
        return kimi_mla(dict(zip(names, ws_)), x_, cfg)

    inputs = [x.requires_grad_()] + [v.requires_grad_() for v in ws]
    if not torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6):
        raise AssertionError("gradcheck failed")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for case_<name>.safetensors")
    parser.add_argument("--check", action="store_true", help="also run autograd gradcheck")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for i, (name, (cfg, batch, seq)) in enumerate(CASES.items()):
        tensors = run_case(cfg, batch, seq, 100 + i)
        meta = {"config": json.dumps(cfg), "batch": str(batch), "seq": str(seq),
                "producer": "python/kimi_reference.py (torch %s, float64)" % torch.__version__}
        path = os.path.join(args.out, f"case_{name}.safetensors")
        safetensors_io.save_file({k: v.numpy() for k, v in tensors.items()}, path, meta)
        back, _ = safetensors_io.load_file(path)
        for k, v in tensors.items():
            if not (back[k] == v.numpy()).all():
                raise AssertionError(f"{path}: {k} did not round-trip exactly")
        print(f"{path}: {len(tensors)} tensors")
    if args.check:
        gradcheck()
        print("gradcheck: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
