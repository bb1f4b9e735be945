"""The block's parameter names in a state dict: the rule the C++ weight
reader follows too (src/tools/block_job.cpp, load_weights), so one file
gives one model in both.

A parameter goes by its DeepSeek inference name (`wkv_b.weight`) or its
Hugging Face name (`kv_b_proj.weight`, DeepseekV3Attention's), either bare or
under `model.layers.<i>.self_attn.`. Refused, naming what to do:
  * a parameter present under more than one of its names (the file holds
    two copies, which may be two models: the C++ took one, the package the
    other);
  * prefixed attention names of several layers when no layer is picked
    (`load_state_dict(sd, layer=i)`; the C++ `--layer i`): loading the last
    one met was silent. With one layer there, that one is taken.
Other tensors of a whole Hugging Face checkpoint (`model.` and not the
picked layer's attention: embeddings, MLPs, norms, other layers once one is
picked) are left out, as the C++ reader reads only the block's; any other
name is passed on as it is (strict loading names it as unexpected)."""

import re

HF_NAMES = {"wq.weight": "q_proj.weight", "wq_a.weight": "q_a_proj.weight",
            "q_norm.weight": "q_a_layernorm.weight", "wq_b.weight": "q_b_proj.weight",
            "wkv_a.weight": "kv_a_proj_with_mqa.weight", "kv_norm.weight": "kv_a_layernorm.weight",
            "wkv_b.weight": "kv_b_proj.weight", "wo.weight": "o_proj.weight",
            "wg.weight": "g_proj.weight"}  # Kimi K3's output gate (src/mla/params.cpp)
# A layer index as laga writes it (no sign, no leading zero, at most 9 digits):
# `model.layers.03.` is no layer's name, in the C++ reader as here.
_PREFIXED = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,8})\.self_attn\.(.+)$")


def _canonical(bare):
    """The DeepSeek name of a bare name, or None when it is no parameter's."""
    if bare in HF_NAMES:
        return bare
    for ds, hf in HF_NAMES.items():
        if hf == bare:
            return ds
    return None


def attention_layers(keys):
    """The layers whose prefixed attention names the keys hold, sorted."""
    out = set()
    for k in keys:
        m = _PREFIXED.match(k)
        if m and _canonical(m.group(2)):
            out.add(int(m.group(1)))
    return sorted(out)


def resolve(state_dict, layer=None):
    """state_dict under DeepSeek names, by the rule above (a ValueError
    naming the names, or the layers and how to pick one)."""
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValueError(f"layer={layer!r}: expected a whole number >= 0 (the i of "
                         "model.layers.<i>.self_attn.*)")
    layers = attention_layers(state_dict)
    if layer is None:
        if len(layers) > 1:
            raise ValueError(f"the state dict holds the attention weights of {len(layers)} layers "
                             f"({', '.join(map(str, layers))}) under model.layers.<i>.self_attn.; "
                             "pick one: load_state_dict(state_dict, layer=i) (laga forward "
                             "--layer i)")
        layer = layers[0] if layers else 0
    found, out = {}, {}
    for k, v in state_dict.items():
        m = _PREFIXED.match(k)
        if m and _canonical(m.group(2)):
            if int(m.group(1)) != layer:
                continue  # another layer's, not picked
            ds = _canonical(m.group(2))
        elif k.startswith("model."):
            continue  # the rest of a whole checkpoint: not this block's
        else:
            ds = _canonical(k)
        if ds is None:
            out[k] = v
            continue
        found.setdefault(ds, []).append(k)
        out[ds] = v
    for ds, names in found.items():
        if len(names) > 1:
            raise ValueError(f"parameter '{ds}' is in the state dict under {len(names)} names, "
                             + ", ".join(f"'{n}'" for n in names[:-1]) + f" and '{names[-1]}'"
                             + "; give each parameter once (two copies may be two models): "
                             "remove all but one")
    return out
