#!/usr/bin/python3
"""One set of config rules for the C++ tool and laga_torch (issue 54, E).

Usage: test_torch_config_parity.py LAGA WORKDIR

Feeds the same config files — every field's bad values (zero, negative,
fractional, strings, bools, lists, past 2^53, non-finite), the YaRN rules
(rope_theta <= 1, factor < 1 or > 1e6, beta_fast <= beta_slow, beta_slow
<= 0, mscale < 0, with YaRN on and off), both JSON formats, the Hugging
Face rope blocks (rope_scaling / rope_parameters alone, both, null, of the
wrong type, unknown keys, contradicting types, mscale against
mscale_all_dim, attention_factor, truncate, partial_rotary_factor, a
rope_theta inside and outside), and files that are not strict JSON (NaN,
Infinity, a key twice, numbers past a double) — to `laga compare
--count-only --json` (the C++ MlaConfig::from_json_file; the config it
resolved is in its JSON) and to laga_torch.MLAConfig.load. Both must accept
the file with the same model (every field, yarn_always included) or both
refuse it (the package with a ValueError). A file the package reads into
another model than the C++, or accepts where the C++ refuses, or refuses
where the C++ accepts, fails: Kimi K3's gated NoPE MLA (mla_use_nope,
mla_use_output_gate, qk_rope_head_dim 0) included, which both run.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

ARGS = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 7, "original_seq_len": 8,
        "max_seq_len": 32, "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0,
        "beta_slow": 1.0, "rope_theta": 10000.0, "norm_eps": 1e-6}
ARGS_PLAIN = dict(ARGS, max_seq_len=8)  # YaRN off: its fields unchecked
# The indexer's three keys, and the configs that carry them whole: laga
# runs those (its DSA forms), the package refuses them by name. Parity there
# is that laga reads the same dense model as the package does from the file
# without the three keys, and the three as given.
DSA = {"index_n_heads": 2, "index_head_dim": 8, "index_topk": 4}
DSA_ONLY_LAGA = ("hf dsa", "args dsa")
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 4.0, "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 0.7}
HF = {"hidden_size": 24, "num_attention_heads": 5, "q_lora_rank": 7, "kv_lora_rank": 10,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
      "max_position_embeddings": 32, "rope_theta": 10000.0, "rope_scaling": YARN}
INTS = ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "q_lora_rank", "original_seq_len", "max_seq_len")
FLOATS = ("rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale", "norm_eps")
HF_INTS = {"hidden_size": "dim", "num_attention_heads": "n_heads", "q_lora_rank": None,
           "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
           "v_head_dim": None, "max_position_embeddings": None}
BIG = 2 ** 53


def drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def configs():
    """(name, JSON text)."""
    out = []

    def add(name, obj):
        out.append((name, json.dumps(obj)))

    add("args", ARGS)
    add("args plain", ARGS_PLAIN)
    add("args bare", {k: ARGS[k] for k in INTS[:6]})
    add("hf", HF)
    add("hf plain", drop(HF, "rope_scaling"))
    # Kimi K3's gated NoPE MLA: both run it (the same model, its two keys
    # included); malformed values, and NoPE with YaRN, are refused by both.
    kimi = dict(drop(HF, "rope_scaling"), mla_use_nope=True, mla_use_output_gate=True)
    add("hf kimi", kimi)
    add("hf kimi in text_config", {"text_config": kimi})
    add("hf kimi gate only", dict(drop(HF, "rope_scaling"), mla_use_output_gate=True))
    add("hf kimi nope only", dict(drop(HF, "rope_scaling"), mla_use_nope=True))
    add("hf kimi off", dict(HF, mla_use_nope=False, mla_use_output_gate=None))
    add("hf kimi nope with yarn", dict(HF, mla_use_nope=True))
    add("hf rope 0", dict(drop(HF, "rope_scaling"), qk_rope_head_dim=0))
    add("args rope 0", dict(ARGS_PLAIN, qk_rope_head_dim=0))
    add("args kimi", dict(ARGS, mla_use_nope=True, mla_use_output_gate=True))
    add("args kimi rope 0", dict(ARGS, qk_rope_head_dim=0, mla_use_output_gate=True))
    add("args kimi yarn_always", dict(ARGS_PLAIN, mla_use_nope=True, yarn_always=True))
    add("args kimi rope 0 bad yarn fields", dict(ARGS, qk_rope_head_dim=0, rope_factor=0.5))
    add("args kimi nope bad yarn fields", dict(ARGS, mla_use_nope=True, beta_fast=0.5))
    add("args kimi odd rope dims", dict(ARGS, mla_use_nope=True, qk_rope_head_dim=3))
    add("hf kimi rope_parameters default", dict(drop(HF, "rope_scaling"), mla_use_nope=True,
                                                rope_parameters={"rope_type": "default"}))
    add("hf kimi rope_scaling type null", dict(HF, mla_use_nope=True,
                                               rope_scaling=dict(YARN, type=None)))
    add("hf kimi nope false with yarn", dict(HF, mla_use_nope=False, mla_use_output_gate=True))
    # DeepSeek-V3.2's indexer keys: `laga compare --count-only` runs the DSA
    # forms on them (DSA_ONLY_LAGA below), the package refuses them by name
    # (it would attend every key); a partial set is refused by both.
    dsa = DSA
    add("hf dsa", dict(HF, **dsa))
    add("args dsa", dict(ARGS, **dsa))
    add("args dsa topk only", dict(ARGS, index_topk=4))
    # laga's fp8 options of DSA: true (or not a boolean) refused by both
    # without the DSA keys, false accepted by both.
    for k in ("index_fp8", "kv_fp8_round_trip"):
        for v in (True, False, 1, "true"):
            add(f"args {k}={v!r}", dict(ARGS, **{k: v}))
    for v in (1, 0, "true", [True]):
        add(f"hf mla_use_nope={v!r}", dict(HF, mla_use_nope=v))
        add(f"args mla_use_output_gate={v!r}", dict(ARGS, mla_use_output_gate=v))
    # Integers: every field, every bad spelling, and the whole-float and bound edges.
    int_bad = [0, -1, -8, 1.5, 24.000001, "8", True, False, [8], {"v": 8}, BIG + 1, -BIG - 1,
               2 ** 64, 1e300, -1e300]
    for k in INTS:
        for v in int_bad + [ARGS[k] * 1.0, None, 2 * ARGS[k], 3]:
            add(f"args {k}={v!r}", dict(ARGS, **{k: v}))
        add(f"args without {k}", drop(ARGS, k))
    for k, ours in HF_INTS.items():
        for v in int_bad + [HF[k] * 1.0, None, 2 * HF[k]]:
            add(f"hf {k}={v!r}", dict(HF, **{k: v}))
        add(f"hf without {k}", drop(HF, k))
    # Numbers: every field with YaRN on and off.
    float_bad = [0, -1, 0.5, 1.0, 1e-30, 1e7, 1e300, -1e300, "1", True, None, [1.0], 2, 0.99999]
    for base_name, base in (("args", ARGS), ("args plain", ARGS_PLAIN)):
        for k in FLOATS:
            for v in float_bad:
                add(f"{base_name} {k}={v!r}", dict(base, **{k: v}))
    for fast, slow in ((1.0, 4.0), (4.0, 4.0), (4.0, 0.0), (4.0, -1.0), (32.0, 1.0), (2.0, 1.9)):
        add(f"args beta {fast}/{slow}", dict(ARGS, beta_fast=fast, beta_slow=slow))
        add(f"args plain beta {fast}/{slow}", dict(ARGS_PLAIN, beta_fast=fast, beta_slow=slow))
    for v in (True, False, None, 1, 0, "true", "yes"):
        add(f"args yarn_always={v!r}", dict(ARGS_PLAIN, yarn_always=v))
        add(f"args yarn_always={v!r} factor 0.5", dict(ARGS_PLAIN, yarn_always=v, rope_factor=0.5))
    add("args q_lora_rank > dim", dict(ARGS, q_lora_rank=25))
    add("args q_lora_rank = dim", dict(ARGS, q_lora_rank=24))
    add("args odd rope dims", dict(ARGS, qk_rope_head_dim=3))
    add("args max_seq_len 2^40", dict(ARGS, max_seq_len=2 ** 40))
    add("args max_seq_len 2^40 + 1", dict(ARGS, max_seq_len=2 ** 40 + 1))
    add("args original_seq_len 2^40 + 1 (YaRN off)", dict(ARGS, original_seq_len=2 ** 40 + 1))
    add("args dims too large", dict(ARGS, n_heads=2 ** 20))
    add("args dim 2^24", dict(ARGS, dim=2 ** 24))
    add("args with rope_scaling (ignored)", dict(ARGS, rope_scaling={"type": "linear"}))
    add("args with hf keys (ignored)", dict(ARGS, num_attention_heads=7, vocab_size=100))
    # HF top-level rope_theta and the rope blocks.
    for v in (0, 1.0, 0.5, -1, 1e300, "1e4", None, 500000):
        add(f"hf rope_theta={v!r}", dict(HF, rope_theta=v))
    for v in (None, "yarn", [], 1, {}):
        add(f"hf rope_scaling={v!r}", dict(HF, rope_scaling=v))
        add(f"hf rope_parameters={v!r}", dict(drop(HF, "rope_scaling"), rope_parameters=v))
    y = YARN
    variants = {
        "type linear": dict(y, type="linear"), "type dynamic": dict(y, type="dynamic"),
        "type default": dict(y, type="default"), "type 3": dict(y, type=3),
        "no type": drop(y, "type"), "rope_type yarn": dict(drop(y, "type"), rope_type="yarn"),
        "type and rope_type agree": dict(y, rope_type="yarn"),
        "type and rope_type contradict": dict(y, rope_type="linear"),
        "type null, rope_type yarn": dict(y, type=None, rope_type="yarn"),
        "factor 0.5": dict(y, factor=0.5), "factor 1": dict(y, factor=1.0),
        "factor 1e7": dict(y, factor=1e7), "factor absent": drop(y, "factor"),
        "factor '4'": dict(y, factor="4"), "beta swapped": dict(y, beta_fast=1.0, beta_slow=4.0),
        "beta equal": dict(y, beta_fast=2.0, beta_slow=2.0), "beta_slow 0": dict(y, beta_slow=0),
        "betas absent": drop(y, "beta_fast", "beta_slow"),
        "mscale != mscale_all_dim": dict(y, mscale=1.0),
        "mscale_all_dim absent": drop(y, "mscale_all_dim"),
        "mscale absent": drop(y, "mscale"), "mscales absent": drop(y, "mscale", "mscale_all_dim"),
        "mscales 1": dict(y, mscale=1.0, mscale_all_dim=1.0),
        "mscales 0": dict(y, mscale=0, mscale_all_dim=0),
        "mscales 0 factor 1": dict(y, mscale=0, mscale_all_dim=0, factor=1.0),
        "mscales negative": dict(y, mscale=-0.5, mscale_all_dim=-0.5),
        "attention_factor 1": dict(y, attention_factor=1.0),
        "attention_factor 0.5": dict(y, attention_factor=0.5),
        "attention_factor null": dict(y, attention_factor=None),
        "attention_factor '1'": dict(y, attention_factor="1"),
        "truncate true": dict(y, truncate=True), "truncate false": dict(y, truncate=False),
        "truncate 1": dict(y, truncate=1), "truncate null": dict(y, truncate=None),
        "partial_rotary_factor 1": dict(y, partial_rotary_factor=1.0),
        "partial_rotary_factor 0.5": dict(y, partial_rotary_factor=0.5),
        "unknown key low_freq_factor": dict(y, low_freq_factor=1.0),
        "unknown key original_max_position": dict(y, original_max_position=8),
        "original absent": drop(y, "original_max_position_embeddings"),
        "original 32 (YaRN by HF's rule)": dict(y, original_max_position_embeddings=32),
        "original 0": dict(y, original_max_position_embeddings=0),
        "original 8.5": dict(y, original_max_position_embeddings=8.5),
        "rope_theta inside": dict(y, rope_theta=10000.0),
        "rope_theta inside, other": dict(y, rope_theta=50000.0),
        "rope_theta inside, null": dict(y, rope_theta=None),
        "rope_theta inside, 0.5": dict(y, rope_theta=0.5),
        "plain": {"type": "default"}, "plain rope_type": {"rope_type": "default"},
        "plain with factor": {"rope_type": "default", "factor": 4.0},
        "plain with partial 0.5": {"rope_type": "default", "partial_rotary_factor": 0.5},
        "plain with theta": {"rope_type": "default", "rope_theta": 50000.0},
        "empty": {},
    }
    for name, block in variants.items():
        add(f"hf rope_scaling {name}", dict(HF, rope_scaling=block))
        p = dict(drop(HF, "rope_scaling"), rope_parameters=block)
        add(f"hf rope_parameters {name}", p)
        add(f"hf rope_parameters {name}, no top rope_theta", drop(p, "rope_theta"))
        add(f"hf rope_parameters {name} and rope_scaling", dict(p, rope_scaling=YARN))
        add(f"hf rope_parameters {name} and rope_scaling null", dict(p, rope_scaling=None))
        add(f"hf rope_scaling {name} and rope_parameters null",
            dict(HF, rope_scaling=block, rope_parameters=None))
    for v in (0, 8, 33, None, "32", 32.0):
        add(f"hf max_position_embeddings={v!r}", dict(HF, max_position_embeddings=v))
        add(f"hf plain max_position_embeddings={v!r}",
            dict(drop(HF, "rope_scaling"), max_position_embeddings=v))
    add("hf rms_norm_eps (not read)", dict(HF, rms_norm_eps=0.5))
    add("hf hidden_size null", dict(HF, hidden_size=None))
    add("hf with args keys", dict(HF, dim=48, n_heads=8))
    # Files that are not strict JSON, or not objects.
    good = json.dumps(ARGS)
    out += [("text NaN", good[:-1] + ', "rope_factor": NaN}'),
            ("text Infinity", good[:-1] + ', "mscale": Infinity}'),
            ("text -Infinity", good[:-1] + ', "beta_slow": -Infinity}'),
            ("text key twice", good[:-1] + ', "dim": 48}'),
            ("text key twice, nested", json.dumps(HF)[:-2] + ', "factor": 8.0}}'),
            ("text 1e400", good[:-1] + ', "rope_theta": 1e400}'),
            ("text integer past a double", good[:-1] + ', "rope_theta": 1' + "0" * 400 + "}"),
            ("text integer past int64", good[:-1] + ', "dim": 99999999999999999999999}'),
            ("text trailing garbage", good + " x"), ("text empty", ""), ("text array", "[1, 2]"),
            ("text null", "null"), ("text number", "3"), ("text truncated", good[:-5]),
            ("text comment", "// c\n" + good), ("text BOM", "\ufeff" + good)]
    return out


def cxx(laga, path, work):
    out = path[:-len(".json")] + "-compare.json"
    if os.path.exists(out):
        os.unlink(out)
    p = subprocess.run([laga, "compare", "--config", path, "--seq", "4", "--sp", "1",
                        "--count-only", "--forms", "explicit", "--json", out],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    if p.returncode == 0:
        return "accept", json.load(open(out))["config"]
    if p.returncode == 2 and "laga: error:" in p.stderr:
        return "refuse", p.stderr.strip()
    sys.exit(f"FAIL: laga compare on {path} exited {p.returncode}: {p.stderr}")


def package(lt, path):
    try:
        c = lt.MLAConfig.load(path)
    except ValueError as e:
        return "refuse", str(e)
    except Exception as e:  # noqa: BLE001: a raw exception is a failure to report
        return "raw", f"{type(e).__name__}: {e}"
    return "accept", c.to_json()


def same_model(theirs, mine):
    bad = {k: (mine.get(k), v) for k, v in theirs.items() if mine.get(k) != v}
    if bool(mine.get("yarn_always", False)) != bool(theirs.get("yarn_always", False)):
        bad["yarn_always"] = (mine.get("yarn_always"), theirs.get("yarn_always", False))
    return bad


def dsa_only_laga(lt, name, text, c, p):
    """A DSA config: laga accepts it with the three keys as given and the
    package's dense model of the file without them; the package refuses it
    naming DeepSeek Sparse Attention."""
    if c[0] != "accept" or p[0] != "refuse" or "DeepSeek Sparse Attention" not in p[1]:
        return [f"{name}: laga {c[0]}s it ({c[1]}), the package {p[0]}s it ({p[1]}); "
                f"expected laga to run it and the package to refuse DSA by name"]
    fails = [f"{name}: laga reads {k} {c[1].get(k)}, the file says {v}"
             for k, v in DSA.items() if c[1].get(k) != v]
    dense = {k: v for k, v in json.loads(text).items() if k not in DSA}
    bad = same_model({k: v for k, v in c[1].items() if k not in DSA},
                     lt.MLAConfig.from_json(dense).to_json())
    if bad:
        fails.append(f"{name}: another dense model: (package, laga) {bad}")
    return fails


def main():
    laga, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    import laga_torch as lt
    t0, fails, n = time.time(), [], {"accept": 0, "refuse": 0}
    paths = []
    for i, (name, text) in enumerate(configs()):
        paths.append(os.path.join(work, f"config-{i}.json"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(text)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # laga's runs, a few at a time
        verdicts = list(pool.map(lambda path: cxx(laga, path, work), paths))
    for (name, text), path, c in zip(configs(), paths, verdicts):
        p = package(lt, path)
        if p[0] == "raw":
            fails.append(f"{name}: the package raised {p[1]} (not a ValueError)")
        elif name in DSA_ONLY_LAGA:
            fails += dsa_only_laga(lt, name, text, c, p)
            continue
        elif c[0] != p[0]:
            fails.append(f"{name}: laga {c[0]}s it ({c[1]}), the package {p[0]}s it ({p[1]})")
        elif c[0] == "accept":
            bad = same_model(c[1], p[1])
            if bad:
                fails.append(f"{name}: another model: (package, laga) {bad}")
        if c[0] == p[0]:
            n[c[0]] += 1
        if c[0] == p[0] == "accept" and not name.startswith("text"):
            # the dict itself (MLAConfig.from_json) reads as the file does
            d = lt.MLAConfig.from_json(json.loads(text)).to_json()
            if d != p[1]:
                fails.append(f"{name}: from_json {d} != load {p[1]}")
    for f in fails:
        print("FAIL:", f)
    total = len(configs())
    if fails:
        sys.exit(f"FAIL: {len(fails)} of {total} configs: the package and laga disagree")
    print(f"ok: {total} configs, the same verdict from laga and the package ({n['accept']} "
          f"accepted with the same model, {n['refuse']} refused by both; "
          f"{time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
