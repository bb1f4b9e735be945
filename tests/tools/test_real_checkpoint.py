#!/usr/bin/env python3
"""Real checkpoints through `laga forward --weights` (issue 26):

  - a sharded checkpoint in DeepSeek-V3's layout (Hugging Face names, F8_E4M3
    weights with F32 weight_scale_inv per 128x128 block, ragged last blocks,
    BF16 norms, an index over three shards, one of them holding only another
    layer) gives bit for bit the `out` and `dx` of the same layer dequantised
    here by numpy (weight_dequant: float32(x) * s[i // 128, j // 128]) and
    given as F32 under DeepSeek names; by the directory and by the index;
  - the layer-0 shard is garbage and is never opened;
  - one layer at DeepSeek-V3's own shapes (--preset deepseek-v3: q_a_proj
    [1536, 7168] with scales [12, 56], ..., o_proj [7168, 16384] with
    [56, 128]), in sparse shards, loads and runs;
  - a malformed index and a scale of the wrong shape exit 2 with one error
    line naming the index or the tensor.

  test_real_checkpoint.py LAGA TMPDIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import safetensors_io  # noqa: E402

laga, tmp = sys.argv[1], os.path.join(sys.argv[2], "real_checkpoint")
os.makedirs(tmp, exist_ok=True)
failures = []

# HF config.json dimensions chosen so every block grid is ragged:
# q_a [136, 200] -> scale [2, 2]; q_b [48, 136] -> [1, 2]; kv_a [80, 200] ->
# [1, 2]; kv_b [80, 72] -> [1, 1]; o [200, 48] -> [2, 1].
config = {"hidden_size": 200, "num_attention_heads": 2, "q_lora_rank": 136,
          "kv_lora_rank": 72, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
          "v_head_dim": 24, "max_position_embeddings": 4096}
H, D = 2, 200
shapes = {  # HF name -> (DeepSeek name, shape)
    "q_a_proj.weight": ("wq_a.weight", (136, D)),
    "q_a_layernorm.weight": ("q_norm.weight", (136,)),
    "q_b_proj.weight": ("wq_b.weight", (H * 24, 136)),
    "kv_a_proj_with_mqa.weight": ("wkv_a.weight", (72 + 8, D)),
    "kv_a_layernorm.weight": ("kv_norm.weight", (72,)),
    "kv_b_proj.weight": ("wkv_b.weight", (H * (16 + 24), 72)),
    "o_proj.weight": ("wo.weight", (D, H * 24)),
}
LAYER = 3
rng = np.random.default_rng(26)


def e4m3(codes):
    """float8_e4m3fn codes -> float32 by the format's formula (NaN not used)."""
    c = codes.astype(np.int64)
    s, e, m = c >> 7, (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where(s == 1, -mag, mag).astype(np.float32)


def to_bf16_bits(a):
    """float32 -> bf16 bits (values chosen exactly representable)."""
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_raw(path, tensors):
    """tensors: name -> (dtype name, shape, raw bytes); a safetensors file."""
    header, data, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(data))


def run(args):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=300)


ckpt = os.path.join(tmp, "ckpt")
os.makedirs(ckpt, exist_ok=True)
config_path = os.path.join(tmp, "config.json")
with open(config_path, "w") as f:
    json.dump(config, f)

shards = {"model-00001-of-00003.safetensors": {}, "model-00002-of-00003.safetensors": {}}
reference = {}  # DeepSeek name -> float32, dequantised by numpy
prefix = f"model.layers.{LAYER}.self_attn."
for k, (hf, (ds, shape)) in enumerate(shapes.items()):
    shard = shards["model-0000%d-of-00003.safetensors" % (1 + k % 2)]
    if len(shape) == 1:
        w = (1 + rng.integers(-8, 8, shape) / 16).astype(np.float32)  # exact in BF16
        shard[prefix + hf] = ("BF16", shape, to_bf16_bits(w).tobytes())
        reference[ds] = w
        continue
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale = (rng.uniform(0.5, 2.0, grid) / 448).astype(np.float32)
    shard[prefix + hf] = ("F8_E4M3", shape, codes.tobytes())
    shard[prefix + hf + "_scale_inv"] = ("F32", grid, scale.tobytes())
    blocks = scale.repeat(128, 0).repeat(128, 1)[:shape[0], :shape[1]]
    reference[ds] = e4m3(codes) * blocks
for name, tensors in shards.items():
    write_raw(os.path.join(ckpt, name), tensors)
# Layer 0 lives in shard 3, which is not safetensors: opening it would fail.
with open(os.path.join(ckpt, "model-00003-of-00003.safetensors"), "wb") as f:
    f.write(b"garbage: this shard must not be opened for layer %d" % LAYER)
weight_map = {n: s for s, ts in shards.items() for n in ts}
for hf in shapes:
    weight_map["model.layers.0.self_attn." + hf] = "model-00003-of-00003.safetensors"
index = os.path.join(ckpt, "model.safetensors.index.json")
with open(index, "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
ref_path = os.path.join(tmp, "reference.st")
safetensors_io.save_file(reference, ref_path)

common = ["forward", "--config", config_path, "--batch", "1", "--seq", "24", "--backward",
          "--form", "explicit", "--layer", str(LAYER)]
outputs = {}
for label, weights in [("reference", ref_path), ("dir", ckpt), ("index", index)]:
    path_out = os.path.join(tmp, label + "_out.st")
    r = run(common + ["--weights", weights, "--output", path_out])
    if r.returncode != 0:
        failures.append(f"forward --weights {label}: rc {r.returncode}: {r.stderr.strip()[:500]}")
        continue
    outputs[label] = safetensors_io.load_file(path_out)[0]
if "reference" in outputs:
    for label in ("dir", "index"):
        for t in ("out", "dx"):
            if label in outputs and not np.array_equal(outputs[label][t], outputs["reference"][t]):
                diff = np.max(np.abs(outputs[label][t] - outputs["reference"][t]))
                failures.append(f"{label}: '{t}' differs from numpy's dequantisation by {diff}")


# One layer at V3's shapes, as the released checkpoint stores it: sparse
# files (the header, the norms and one fp8 code written; the rest holes of
# zeros), so ~190 MB of tensors cost a few KB of disk.
V3 = {"q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,),
      "q_b_proj.weight": (128 * 192, 1536), "kv_a_proj_with_mqa.weight": (512 + 64, 7168),
      "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (128 * 256, 512),
      "o_proj.weight": (7168, 128 * 128)}


def write_sparse(path, tensors):
    """tensors: name -> (dtype, shape, {byte offset: bytes}); data sparse."""
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, _ = tensors[name]
        n = int(np.prod(shape)) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            for at, raw in tensors[name][2].items():
                f.seek(start + header[name]["data_offsets"][0] + at)
                f.write(raw)
        f.truncate(start + offset)


v3 = os.path.join(tmp, "v3")
os.makedirs(v3, exist_ok=True)
p5 = "model.layers.5.self_attn."
v3_shards = [{}, {}]
for k, (hf, shape) in enumerate(V3.items()):
    shard = v3_shards[0 if k < 3 else 1]
    if len(shape) == 1:
        shard[p5 + hf] = ("BF16", shape, {0: to_bf16_bits(np.ones(shape)).tobytes()})
        continue
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    # w[0, 0] = 1 · 0.5 in every weight, and in kv_b_proj also row 128 (head
    # 0's first v row, in block row 1): so out[..., 0] alone is nonzero.
    codes = {0: b"\x38", 128 * 512: b"\x38"} if hf == "kv_b_proj.weight" else {0: b"\x38"}
    shard[p5 + hf] = ("F8_E4M3", shape, codes)
    shard[p5 + hf + "_scale_inv"] = ("F32", grid, {0: np.full(grid, 0.5, np.float32).tobytes()})
v3_map = {}
for k, tensors in enumerate(v3_shards):
    name = "model-%05d-of-00163.safetensors" % (k + 1)
    write_sparse(os.path.join(v3, name), tensors)
    v3_map.update({t: name for t in tensors})
with open(os.path.join(v3, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": v3_map}, f)
r = run(["forward", "--preset", "deepseek-v3", "--layer", "5", "--batch", "1", "--seq", "2",
         "--weights", v3, "--output", os.path.join(tmp, "v3_out.st")])
if r.returncode != 0:
    failures.append(f"V3 dims: rc {r.returncode}: {r.stderr.strip()[:500]}")
else:
    out = safetensors_io.load_file(os.path.join(tmp, "v3_out.st"))[0]["out"]
    if (out.shape != (1, 2, 7168) or not np.all(np.isfinite(out)) or np.any(out[..., 1:])
            or not np.all(out[..., 0])):
        failures.append(f"V3 dims: out {out.shape} should be finite, nonzero in column 0 only: "
                        f"{out[..., :3]}, {np.count_nonzero(out)} nonzero")
shutil.rmtree(v3)  # sparse, but 187 MB to anything that copies it

def expect_error(args, fragments):
    r = run(args)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("laga: error:")]
    if r.returncode != 2 or len(lines) != 1 or not all(f in lines[0] for f in fragments):
        failures.append(f"{args[-1]}: expected exit 2 and one error naming {fragments}; "
                        f"got rc {r.returncode}: {r.stderr.strip()[:500]}")


bad = os.path.join(tmp, "bad_index")
os.makedirs(bad, exist_ok=True)
with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
    f.write('{"weight_map": {"a": ')
expect_error(common + ["--weights", bad], ["model.safetensors.index.json", "not valid JSON"])

one = os.path.join(tmp, "bad_scale.st")
tensors = {}
for name, tensors_of_shard in shards.items():
    tensors.update(tensors_of_shard)
dtype, shape, raw = tensors[prefix + "o_proj.weight_scale_inv"]
tensors[prefix + "o_proj.weight_scale_inv"] = (dtype, (1, 1), raw[:4])
write_raw(one, tensors)
expect_error(common + ["--weights", one], [prefix + "o_proj.weight_scale_inv", "[2, 1]"])

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("real checkpoint: fp8 sharded == numpy dequantised, bit for bit; refusals named")
