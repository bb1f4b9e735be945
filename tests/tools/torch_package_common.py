"""What tools_torch_package (test_torch_package.py) and laga_fused's Triton
test (test_torch_fused_triton.py) share: the configs, documents and cases
both run (and the config files in each spelling laga reads); the token
layout of a rank's shard; the `laga` flags and compare names a case maps
to; running a command that must succeed; the relative error both hold
tensors to; and the whole tensors assembled from the ranks' saved shards."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(HERE, "..", "..", "python")
sys.path.insert(0, PY)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import safetensors_io  # noqa: E402

B, S = 2, 13  # S % P != 0 for P 2, 3, 4
# H 5: H % P != 0 for P 2, 3, 4; dv 6 != dqk 12; YaRN on (max > original).
BASE = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 6, "original_seq_len": 8, "max_seq_len": 32,
        "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0, "beta_slow": 1.0}
# h3: H 3 < P 4, a rank without heads (SpLayout heads 1+1+1+0).
CONFIGS = {"rq0": dict(BASE, q_lora_rank=0), "rq7": dict(BASE, q_lora_rank=7),
           "h3": dict(BASE, q_lora_rank=7, n_heads=3)}
# Documents straddling every shard boundary at P 2-4 (shards of 13: 7+6,
# 5+4+4, 4+3+3+3), a one-token document, per-row lists.
DOCS = [[0, 3, 9, 10, 13], [0, 6, 13]]

# Config files in both spellings laga reads, for the config check: the HF
# one is rq7's block (YaRN from its rope_scaling), the bare ones lean on
# each format's defaults.
HF = {"hidden_size": 24, "num_attention_heads": 5, "q_lora_rank": 7, "kv_lora_rank": 10,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
      "max_position_embeddings": 32, "rope_theta": 10000.0,
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                       "beta_fast": 4.0, "beta_slow": 1.0, "mscale": 0.7,
                       "mscale_all_dim": 0.7}}
CONFIG_FILES = {"hf": HF, "hf-plain": {k: v for k, v in HF.items() if k != "rope_scaling"},
                "hf-yarn-always": dict(HF, max_position_embeddings=8),  # HF's rule, not DeepSeek's
                "args-bare": {k: BASE[k] for k in ("dim", "n_heads", "kv_lora_rank",
                                                   "qk_nope_head_dim", "qk_rope_head_dim",
                                                   "v_head_dim")}}

# (name, config, form, options)
VARIANTS = [("explicit", "rq0", "explicit", {}), ("absorbed", "rq0", "absorbed", {}),
            ("laga", "rq0", "laga", {}), ("laga2d", "rq0", "laga2d", {}),
            ("explicit", "rq7", "explicit", {}), ("absorbed", "rq7", "absorbed", {}),
            ("laga", "rq7", "laga", {}), ("laga2d-g1", "rq7", "laga2d", {"head_groups": 1}),
            ("laga-q-latent", "rq7", "laga", {"q_latent": True}),
            ("laga2d-g1-q-latent", "rq7", "laga2d", {"head_groups": 1, "q_latent": True}),
            ("laga-overlap", "rq7", "laga", {"overlap": True}),
            ("laga2d-overlap", "rq7", "laga2d", {"overlap": True}),
            ("explicit", "h3", "explicit", {}), ("absorbed", "h3", "absorbed", {}),
            ("laga", "h3", "laga", {}), ("laga-q-latent", "h3", "laga", {"q_latent": True}),
            # laga_fused: laga's flow, K/V made inside the flash call and never
            # kept (fused.py); eager runs laga's path, as the C++ form does.
            ("laga_fused", "rq0", "laga_fused", {}), ("laga_fused", "rq7", "laga_fused", {}),
            ("laga_fused-q-latent-overlap", "rq7", "laga_fused",
             {"q_latent": True, "overlap": True}),
            ("laga_fused", "h3", "laga_fused", {}),
            # The context-parallel forms: each rank its own tokens with all heads
            # (H 5 never split); the rings' overlap (one engine, ring.py) once.
            ("allgather_kv", "rq7", "allgather_kv", {}), ("ring_kv", "rq7", "ring_kv", {}),
            ("ring_latent", "rq7", "ring_latent", {}),
            ("ring_latent-overlap", "rq7", "ring_latent", {"overlap": True}),
            # The hierarchical a2a_p2p: at H 5 and P <= 4 its default grid is
            # one head group (the all-to-alls move tokens to the zigzag chunks,
            # the ring runs over all ranks); the grids with Ph > 1 are the C++
            # tests' (tests/mla/test_forms.cpp, "Grids").
            ("a2a_p2p", "rq7", "a2a_p2p", {}),
            ("a2a_p2p-overlap", "rq7", "a2a_p2p", {"overlap": True})]
# The zigzag layout (seq_layout "zigzag", laga's --seq-layout zigzag): every
# form on two ranges a rank, S 13 cut into 2P chunks of unequal length (at P 4
# 2+2+2+2+2+1+1+1: rank 0 [0, 2) and [12, 13), rank 3 one merged range), the
# rings' rectangles (RingRect) other than every row x every key.
ZIGZAG = {"seq_layout": "zigzag"}
VARIANTS += [(name + "-zigzag", "rq7", form, dict(opts, **ZIGZAG)) for name, form, opts in (
    ("explicit", "explicit", {}), ("absorbed", "absorbed", {}), ("laga", "laga", {}),
    ("laga2d", "laga2d", {}), ("laga2d-g1", "laga2d", {"head_groups": 1}),
    ("laga_fused", "laga_fused", {}), ("allgather_kv", "allgather_kv", {}), ("ring_kv", "ring_kv", {}),
    ("ring_latent", "ring_latent", {}), ("ring_kv-overlap", "ring_kv", {"overlap": True}),
    ("a2a_p2p", "a2a_p2p", {}))]
PACKED = ["explicit", "absorbed", "laga", "laga_fused", "laga2d-g1", "laga-q-latent", "allgather_kv",
          "ring_kv", "ring_latent", "laga-zigzag", "allgather_kv-zigzag", "ring_kv-zigzag",
          "ring_latent-zigzag", "a2a_p2p"]
# attention "flash" as well (float64, float32; bf16 and autograd's tape for a
# few): each form, H 3 (a rank without heads at P 4), packed, q_latent,
# laga2d at both grids. Tiles of 4 rows x 4 keys over S 13: tiles skipped,
# masked and whole, documents and shards cutting through them.
FLASH = {"rq0-explicit", "rq0-absorbed", "rq0-laga", "rq0-laga2d", "rq7-laga2d-g1-q-latent",
         "h3-absorbed", "h3-laga-q-latent", "rq7-explicit-packed", "rq7-absorbed-packed",
         "rq7-laga2d-g1-packed", "rq7-laga-q-latent-packed",
         "rq7-allgather_kv", "rq7-ring_kv", "rq7-ring_latent",
         "rq7-allgather_kv-packed", "rq7-ring_kv-packed", "rq7-laga2d-zigzag",
         "rq7-allgather_kv-zigzag-packed", "rq7-ring_kv-zigzag", "rq7-ring_latent-zigzag-packed",
         "rq7-a2a_p2p", "rq7-a2a_p2p-packed", "rq0-laga_fused", "rq7-laga_fused",
         "rq7-laga_fused-q-latent-overlap", "h3-laga_fused", "rq7-laga_fused-packed",
         "rq7-laga_fused-zigzag"}
FLASH_BF16 = {"rq7-laga2d-g1-q-latent", "rq7-ring_latent", "rq7-laga_fused"}
FLASH_AUTOGRAD = {"rq0-laga2d", "rq7-absorbed-packed", "rq7-ring_latent-overlap",
                  "rq7-ring_kv-zigzag-packed", "rq7-a2a_p2p-packed", "rq7-laga_fused-packed",
                  "rq7-laga_fused-q-latent-overlap"}
FLASH_BLOCK = 4


def sdpa_case(lt, case):
    """torch's scaled_dot_product_attention (tape autograd) runs every form
    but the rings (their lse merge needs what SDPA does not return), where
    this torch has it (2.x; Debian's 1.13 does not)."""
    from laga_torch.attention import has_sdpa
    return has_sdpa() and not lt.FORMS[case["form"]].ring


def cases():
    out = []
    for name, cfg, form, opts in VARIANTS:
        out.append({"id": f"{cfg}-{name}", "cfg": cfg, "form": form, "opts": opts, "docs": None})
        if name in PACKED and cfg == "rq7":
            out.append({"id": f"{cfg}-{name}-packed", "cfg": cfg, "form": form, "opts": opts,
                        "docs": DOCS})
    return out


def compare_rows(form):
    """A laga compare JSON form's ledger: (phase, label) -> (calls, sent, received)."""
    return {(l["phase"], l["label"]): (l["calls"], l["bytes_sent"], l["bytes_received"])
            for l in form["by_label"]}


def max_over_ranks(per_rank, case_id, key):
    """The ranks' ledgers (each rank's saved rows under `key`) as compare
    reports them: per (phase, label), the maximum over ranks of each count."""
    got = {}
    for rows in per_rank:
        for ph, lb, calls, sent, recv in rows[case_id][key]:
            c0 = got.get((ph, lb), (0, 0, 0))
            got[(ph, lb)] = (max(c0[0], calls), max(c0[1], sent), max(c0[2], recv))
    return got


def bf16_case(case):
    return case["cfg"] == "rq7" and not case["docs"] and seq_layout(case) == "contiguous"


def seq_layout(case):
    return case["opts"].get("seq_layout", "contiguous")


def shard(lt, P, r, layout="contiguous"):
    """Rank r's tokens (a long tensor of positions) under the layout."""
    return torch.tensor(lt.SpLayout.even(S, BASE["n_heads"], P, layout).positions(r))


def cxx_flags(case):
    o = case["opts"]
    f = ["--form", case["form"]]
    if o.get("q_latent"):
        f.append("--q-latent")
    if o.get("overlap"):
        f += ["--overlap", "on"]
    if o.get("head_groups"):
        f += ["--head-groups", str(o["head_groups"])]
    return f + ["--seq-layout", seq_layout(case)]


def compare_name(case):
    o = case["opts"]
    return case["form"] + ("+q-latent" if o.get("q_latent") else "") + \
        ("+overlap" if o.get("overlap") else "")


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def rel(a, ref):
    """max |a - ref| / max |ref| (inf where a is not finite)."""
    scale = float(np.abs(ref).max())
    d = float(np.abs(a - ref).max()) if a.size else 0.0
    if not np.isfinite(a).all():
        return float("inf")
    return d / scale if scale > 0 else d


def assemble(lt, workdir, tag, case, P):
    """The whole (B, S, .) out and dx from each rank's shard, each token at
    its position under the case's layout, and every gradient summed over the
    ranks."""
    parts = [safetensors_io.load_file(os.path.join(
        workdir, f"torch-{tag}-{case['id']}-P{P}-r{r}.safetensors"))[0] for r in range(P)]
    full = {}
    for k in ("out", "dx"):
        full[k] = np.zeros((B, S) + parts[0][k].shape[2:], parts[0][k].dtype)
        for r, p in enumerate(parts):
            full[k][:, shard(lt, P, r, seq_layout(case)).numpy()] = p[k]
    for k in parts[0]:
        if k.startswith("grad."):
            full[k] = sum(p[k] for p in parts)
    return full
