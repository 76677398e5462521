"""The draft's contract with SGLang's `LlamaForCausalLMEagle3` loader (also what vLLM reads):
the config.json the export writes, its inverse, and the checks of a config and of the tensor
names and shapes against the parameters that loader fills.

SGLang 0.5.23's `LlamaForCausalLMEagle3.load_weights` silently skips names it does not know, so
`check_tensors` replays its name mapping (legacy `midlayer` -> `layers.0`, q/k/v -> qkv_proj,
gate/up -> gate_up_proj, then the name or `model.<name>` must be a parameter) against the
parameter shapes the config implies, and reports anything unconsumed, missing or misshaped.

One config serves both engines although they number the aux layers differently: SGLang reads
only `eagle_config.eagle_aux_hidden_state_layer_ids` (output of layer i; it adds 1 itself),
vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` first (input of layer i: SGLang id +
1). Both keys are written, and a config where they disagree is refused.

Pure functions over dicts (no I/O); draftsmith.algorithms.export writes and reads the files.
"""

from __future__ import annotations

from draftsmith.algorithms.eagle3.model import SWITCHES, DraftConfig
from draftsmith.algorithms.spec import ALGORITHM_KEY, AlgorithmSpec

ARCH = "LlamaForCausalLMEagle3"
SPECULATORS = True  # a speculators copy can carry this draft (per algorithm: spec.speculators)
# (SGLang fused parameter, checkpoint shard name, shard id), as in load_weights
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
LEGACY = {"midlayer": "layers.0"}


class ContractError(ValueError):
    """A config.json that is not an EAGLE-3 draft in SGLang's contract."""


def sglang_config(cfg: DraftConfig) -> dict:
    """The draft's config.json (Llama fields + EAGLE-3 keys + its algorithm's keys) in
    SGLang's contract."""
    heads = {"num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
    biases = {"attention_bias": False, "mlp_bias": False}
    return eagle3_config(cfg, ARCH, "llama", heads, biases)


def eagle3_config(cfg: DraftConfig, arch: str, model_type: str, heads: dict, biases: dict):
    """The config.json of a one-layer EAGLE-3 draft of architecture `arch`: its attention's
    head keys (`heads`) and bias flags (`biases`) where the model type puts them, the EAGLE-3
    keys and the algorithm's (the key order is the export's: config.json bytes stay the same)."""
    return {
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        **heads,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        **biases,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # vLLM's reading of the same layers (it looks here before eagle_config); SGLang ignores it
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(cfg.aux_layer_ids),
        "norm_before_residual": False,
        ALGORITHM_KEY: cfg.algorithm,
        **switch_keys(cfg),
    }


def switch_keys(cfg: DraftConfig) -> dict:
    """The config.json keys of the layer switches the draft has on (EAGLE-3.1's fc_norm and
    norm_output: both engines read them under the EAGLE-3 architecture)."""
    return {k: True for k in SWITCHES if getattr(cfg, k)}


def switch_params(c: dict) -> dict[str, tuple]:
    """SGLang's parameters a switch on in config.json `c` adds: `model.fc_norm.{i}.weight`, one
    [target_hidden] norm per aux state (norm_output adds none)."""
    if c.get("fc_norm") is not True:
        return {}
    width = c.get("target_hidden_size", c.get("hidden_size"))
    n_aux = len((c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])
    return {f"model.fc_norm.{i}.weight": (width,) for i in range(n_aux)}


def vllm_layer_ids(sglang_ids) -> list[int]:
    """SGLang "output of layer i" -> vLLM/speculators/HF "input of layer i + 1"."""
    return [int(i) + 1 for i in sglang_ids]


def full_vocab(c: dict) -> bool:
    """The draft predicts the whole target vocabulary: no d2t/t2d in the export."""
    return c["draft_vocab_size"] == c["vocab_size"]


def config_from_sglang(c: dict, spec: AlgorithmSpec) -> DraftConfig:
    """Inverse of `sglang_config` for a draft of algorithm `spec` (its name and switches;
    checks the contract keys on the way)."""
    problems = config_problems(c)
    if problems:
        raise ContractError("; ".join(problems))
    return draft_config(
        c,
        spec,
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
    )


def draft_config(c: dict, spec: AlgorithmSpec, **heads) -> DraftConfig:
    """The DraftConfig of checked config.json `c`'s fields every EAGLE-3 contract shares, for
    algorithm `spec`; `heads`: the contract's own (key/value heads, head width, attention)."""
    return DraftConfig(
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=c["draft_vocab_size"],
        aux_layer_ids=list(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c.get("rope_theta", 10000.0),
        rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=c.get("max_position_embeddings", 8192),
        hidden_act=c.get("hidden_act", "silu"),
        algorithm=spec.name,
        **spec.draft,
        **heads,
    )


def config_problems(c: dict) -> list[str]:
    want = {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    out = [
        f"config.json {k} is {c.get(k)!r}, SGLang needs {v!r}"
        for k, v in want.items()
        if c.get(k) != v
    ]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "rms_norm_eps",
        "vocab_size",
        "draft_vocab_size",
    ):
        if k not in c:
            out.append(f"config.json has no {k!r}")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        out.append(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}")
    if (c.get("eagle_config") or {}).get("use_aux_hidden_state") is not True:
        out.append("config.json eagle_config.use_aux_hidden_state must be true")
    if c.get("rope_parameters") is not None:
        out.append("config.json has rope_parameters: SGLang would prefer it over rope_theta")
    top = c.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and top != vllm_layer_ids(ids):
        out.append(
            f"config.json eagle_aux_hidden_state_layer_ids is {top!r}: vLLM reads it before "
            f"eagle_config and needs the SGLang ids + 1, {vllm_layer_ids(ids)} (re-export the "
            "draft: an older export feeds vLLM states one layer too early)"
        )
    if c.get("norm_before_residual", False) is not False:
        out.append("config.json norm_before_residual must be false (SGLang/EAGLE-3 layer)")
    return out


def sglang_params(c: dict) -> dict[str, tuple]:
    """Parameter name -> shape of SGLang's LlamaForCausalLMEagle3 (TP 1) for this config."""
    h, i = c["hidden_size"], c["intermediate_size"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim", h // nh)
    ht = c.get("target_hidden_size", h)
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.fc.weight": (h, ht * n_aux),
        p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "mlp.gate_up_proj.weight": (2 * i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["draft_vocab_size"], h),
        **switch_params(c),
    }


def _shard_rows(c: dict, shard_id) -> int:
    nh = c["num_attention_heads"]
    hd = c.get("head_dim", c["hidden_size"] // nh)
    return {
        "q": nh * hd,
        "k": c.get("num_key_value_heads", nh) * hd,
        "v": c.get("num_key_value_heads", nh) * hd,
    }.get(shard_id, c["intermediate_size"])


def sglang_destination(name: str, params: dict) -> tuple[str, object] | None:
    """Where SGLang's load_weights puts checkpoint tensor `name`: (param, shard id) or None."""
    for legacy, new in LEGACY.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name or "t2d" in name:
        return ("d2t" if "d2t" in name else "t2d"), None
    for param, shard, shard_id in STACKED:
        if shard in name:
            name = name.replace(shard, param)
            full = name if name in params else f"model.{name}"
            return (full, shard_id) if full in params else None
    full = name if name in params else f"model.{name}"
    return (full, None) if full in params else None


def check_tensors(c: dict, tensors: dict[str, tuple[tuple, str]]) -> list[str]:
    """Problems with {name: (shape, safetensors dtype tag)} against what SGLang consumes for config `c`."""
    params = sglang_params(c)
    fused = {
        "model.layers.0.self_attn.qkv_proj.weight": {"q", "k", "v"},
        "model.layers.0.mlp.gate_up_proj.weight": {0, 1},
    }
    return replay_loader(
        c,
        tensors,
        params,
        sglang_destination,
        lambda param, shard: (_shard_rows(c, shard), params[param][1]),
        fused,
    )


def replay_loader(c, tensors, params, destination, shard_shape, fused) -> list[str]:
    """Problems with {name: (shape, safetensors dtype tag)} against an SGLang draft class's
    load_weights for config `c`: `params` its parameter shapes, `destination(name, params)`
    where its loader puts a checkpoint tensor ((param, shard) or None: skipped),
    `shard_shape(param, shard)` the shape one shard of a fused parameter takes, `fused`
    {fused param: the shards it needs}. Anything skipped, misshaped or missing is reported;
    embed_tokens is the target's (shared) and d2t/t2d exist only for a draft vocabulary."""
    problems, filled = [], {}
    for name, (shape, dtype) in sorted(tensors.items()):
        dest = destination(name, params)
        if dest is None:
            problems.append(f"tensor {name} {list(shape)}: SGLang's loader would skip it")
            continue
        param, shard = dest
        if param == "model.embed_tokens.weight":
            problems.append(f"tensor {name}: the draft must not carry embed_tokens (shared)")
            continue
        if param == "d2t":
            want, want_dtype = (c["draft_vocab_size"],), "I64"
        elif param == "t2d":
            want, want_dtype = (c["vocab_size"],), "BOOL"
        elif shard is None:
            want, want_dtype = params[param], None
        else:
            want, want_dtype = shard_shape(param, shard), None
        if tuple(shape) != tuple(want):
            problems.append(f"tensor {name} is {list(shape)}, SGLang's {param} needs {list(want)}")
        if want_dtype and dtype != want_dtype:
            problems.append(f"tensor {name} is {dtype}, expected {want_dtype}")
        filled.setdefault(param, set()).add(shard)
    if full_vocab(c):
        problems += [
            f"tensor {k}: a full-vocabulary draft must not carry it (vLLM refuses d2t there)"
            for k in ("d2t", "t2d")
            if k in filled
        ]
    for param in [*params, *([] if full_vocab(c) else ["d2t", "t2d"])]:
        if param == "model.embed_tokens.weight":
            continue
        missing = fused.get(param, {None}) - filled.get(param, set())
        if missing:
            problems.append(
                f"SGLang parameter {param} is not (fully) provided: {sorted(map(str, missing))}"
            )
    return problems
