"""peft adapters for mlx-lm, fused mlx-lm models back to transformers, served == trained.

- `peft_to_mlx`: a peft adapter as an mlx-lm adapter dir (adapters.safetensors +
  adapter_config.json, LoRASwitchLinear layout; layouts in moetune.train.mlx.format).
- `mlx_to_peft`, `hf_to_mlx` (re-exported): an mlx-lm adapter as a peft adapter; a
  transformers base as an mlx-lm model dir (the mlx stack uses both, so they live in train/).
- `fused_to_hf`: an `mlx_lm.fuse` output (stacked `switch_mlp.*` experts, which transformers
  5 loads without error but with random experts: MLX-FUSED-KEYS) rebuilt as transformers'
  own model and saved by transformers, so it loads exactly.
- `served_matches_trained`: the peft adapter in transformers and its mlx-lm conversion in
  mlx-lm give the same logits on the same tokens (float32, relative norm).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.export.registry import Exporter, ExportResult, register
from moetune.model import ModelSpec, load_spec, spec_from_config
from moetune.model.derive import causal_lm_class
from moetune.model.weight_files import checkpoint_files, read_header, refuse_twice
from moetune.train.mlx.base import SIDE_FILES, hf_to_mlx, mlx_dtype
from moetune.train.mlx.format import (
    MLX_CONFIG,
    MLX_KEY,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_KEY,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    MlxFormatError,
    MlxNames,
    commit_dir,
    fresh_dir,
    load_tensors,
    mlx_names,
    mlx_to_peft,
    read_json,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "export_mlx",
    "fused_to_hf",
    "hf_to_mlx",
    "mlx_to_peft",
    "peft_to_mlx",
    "served_matches_trained",
]
_LAYER_KEY = re.compile(r"^(?P<layers>.+\.layers)\.(?P<i>\d+)\.(?P<rel>.+)\.(?P<leaf>weight|bias)$")
MlxExportError = MlxFormatError  # one error class for every mlx conversion


# ---------------------------------------------------------------- peft -> mlx


@dataclass
class Delta:
    """One adapted module's factors in mlx-lm's layout, and its own scale."""

    a: torch.Tensor  # (in, r) or (E, r, in)
    b: torch.Tensor  # (r, out) or (E, out, r)
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[-1] if self.a.dim() == 2 else self.a.shape[1])


def _peft_factors(tensors: dict[str, torch.Tensor]) -> dict[tuple[str, int, str, int], dict]:
    """(layers prefix, layer, module, nesting depth) -> {"A": …, "B": …}."""
    found: dict[tuple[str, int, str, int], dict] = {}
    for key, value in tensors.items():
        match = PEFT_KEY.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise MlxExportError(
                f"adapter tensor {key} is not a LoRA factor moetune can convert",
                "convert plain LoRA adapters (no DoRA, no trained biases or embeddings)",
            )
        depth = match["nest"].count("base_layer.")
        found.setdefault((match["layers"], int(match["i"]), match["rel"], depth), {})[
            match["ab"]
        ] = value
    return found


def _pattern(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """peft's rank/alpha pattern lookup: a key matches a name's dotted suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _peft_scale(config: dict[str, Any], name: str, rank: int) -> float:
    alpha = _pattern(config.get("alpha_pattern", {}), name, config["lora_alpha"])
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _stack_param(config: dict[str, Any], names: MlxNames, rel: str, depth: int) -> str | None:
    """The expert stack a nested ParamWrapper at `rel` adapts (None: a Linear). peft nests
    in the module's parameter order (the first found is the inner `base_layer`), not in the
    saved config's order (a set's)."""
    targeted = config.get("target_parameters") or []
    params = [
        p
        for p in names.stacks
        if p.rsplit(".", 1)[0] == rel and any(p == t or p.endswith("." + t) for t in targeted)
    ]
    return params[len(params) - 1 - depth] if params and depth < len(params) else None


def _split_gate_up(a: Any, b: Any, names: MlxNames) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """peft's gate_up factors -> (gate, up) mlx factors; undoes `_join_gate_up`'s block
    diagonal (exactly zero off-diagonal blocks) so mlx -> peft -> mlx is the identity."""
    rows = b.shape[1]
    gate_rows = slice(0, rows, 2) if names.interleaved else slice(0, rows // 2)
    up_rows = slice(1, rows, 2) if names.interleaved else slice(rows // 2, rows)
    bg, bu = b[:, gate_rows], b[:, up_rows]
    r2 = a.shape[1]
    if r2 % 2 == 0 and not bg[..., r2 // 2 :].any() and not bu[..., : r2 // 2].any():
        h = r2 // 2
        return (a[:, :h], bg[..., :h]), (a[:, h:], bu[..., h:])
    return (a, bg), (a.clone(), bu)


def peft_deltas(adapter_dir: Path, spec: ModelSpec) -> dict[str, Delta]:
    """Every LoRA factor pair of a peft adapter as mlx-lm module -> Delta."""
    config = read_json(adapter_dir / PEFT_CONFIG)
    names, experts = mlx_names(spec), spec.num_experts
    deltas: dict[str, Delta] = {}
    for (layers, i, rel, depth), ab in _peft_factors(
        load_tensors(adapter_dir / PEFT_WEIGHTS)
    ).items():
        A, B = ab["A"], ab["B"]
        param = _stack_param(config, names, rel, depth)
        prefix = f"{layers}.{i}."
        if param is None or param not in names.stacks:  # a Linear (or a 2-D weight)
            scale = _peft_scale(config, f"{rel}", A.shape[0])
            deltas[prefix + names.to_mlx(rel)] = Delta(A.T.contiguous(), B.T.contiguous(), scale)
            continue
        r = A.shape[0] // experts
        a = A.reshape(experts, r, A.shape[1])
        b = B.reshape(B.shape[0], r, experts).permute(2, 0, 1).contiguous()
        scale = _peft_scale(config, param, r)
        targets = names.stacks[param]
        parts = _split_gate_up(a, b, names) if len(targets) == 2 else ((a, b),)
        for target, (pa, pb) in zip(targets, parts, strict=True):
            deltas[prefix + target] = Delta(pa.contiguous(), pb.contiguous(), scale)
    return deltas


def _uniform(deltas: dict[str, Delta]) -> tuple[int, float, dict[str, torch.Tensor]]:
    """One rank and one scale for mlx-lm: lower ranks padded with zeros, other scales folded
    into b; returns (rank, scale, mlx-lm tensors)."""
    # lazy: heavy to import (torch)
    import torch

    rank = max(d.rank for d in deltas.values())
    scales = [d.scale for d in deltas.values()]
    scale = max(set(scales), key=scales.count)
    out: dict[str, torch.Tensor] = {}
    for name, d in deltas.items():
        pad = rank - d.rank
        if d.a.dim() == 2:
            a = torch.nn.functional.pad(d.a, (0, pad))
            b = torch.nn.functional.pad(d.b, (0, 0, 0, pad))
        else:
            a = torch.nn.functional.pad(d.a, (0, 0, 0, pad))
            b = torch.nn.functional.pad(d.b, (0, pad))
        out[f"{name}.lora_a"] = a.contiguous()
        out[f"{name}.lora_b"] = (b * (d.scale / scale)).contiguous() if d.scale != scale else b
    return rank, scale, out


def peft_to_mlx(
    adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, *,
    overwrite: bool = False,
) -> Path:  # fmt: skip
    """A peft adapter as an mlx-lm adapter dir (adapters.safetensors + adapter_config.json,
    loadable with `mlx_lm.load(model, adapter_path=…)`). `base`: the HF model the adapter
    was trained on (default: the adapter config's base_model_name_or_path)."""
    # lazy: heavy to import (safetensors)
    from safetensors.torch import save_file

    src, out = Path(adapter_dir), Path(out_dir)
    config = read_json(src / PEFT_CONFIG)
    spec = load_spec(base or config["base_model_name_or_path"])
    rank, scale, tensors = _uniform(peft_deltas(src, spec))
    keys = sorted({MLX_KEY.match(k)["rel"] for k in tensors})  # type: ignore[index]
    tmp = fresh_dir(out, overwrite)
    save_file(tensors, str(tmp / MLX_WEIGHTS), metadata={"format": "mlx"})
    mlx_config = {
        "fine_tune_type": "lora",
        "num_layers": -1,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys},
        "model": base or config["base_model_name_or_path"],
    }
    (tmp / MLX_CONFIG).write_text(json.dumps(mlx_config, indent=2), encoding="utf-8")
    return commit_dir(tmp, out)


# ---------------------------------------------------------------- fused mlx -> transformers


def _hf_key(key: str, names: MlxNames) -> str:
    match = _LAYER_KEY.match(key)
    if match is None:
        return key
    return f"{match['layers']}.{match['i']}.{names.to_hf(match['rel'])}.{match['leaf']}"


def _hf_state(weights: dict[str, torch.Tensor], names: MlxNames) -> dict[str, torch.Tensor]:
    """mlx keys -> transformers state-dict keys: switch_mlp stacks joined into the fused
    expert parameters, the MoE block renamed (mixtral: block_sparse_moe -> mlp)."""
    # lazy: heavy to import (torch)
    import torch

    mlx_to_param = {t: p for p, targets in names.stacks.items() for t in targets}
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in weights.items():
        match = _LAYER_KEY.match(key)
        if match is None or match["rel"] not in mlx_to_param or match["leaf"] != "weight":
            state[_hf_key(key, names)] = value
            continue
        param = mlx_to_param[match["rel"]]
        slots = parts.setdefault(f"{match['layers']}.{match['i']}.{param}", {})
        slots[names.stacks[param].index(match["rel"])] = value
    for key, slots in parts.items():
        tensors = [slots[i] for i in sorted(slots)]
        if len(tensors) == 2 and names.interleaved:  # gate/up alternate along the rows
            state[key] = torch.stack(tensors, dim=2).flatten(1, 2)
        else:
            state[key] = torch.cat(tensors, dim=1)
    return state


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    # lazy: heavy to import (safetensors)
    from safetensors.torch import load_file

    files = checkpoint_files(model_dir)  # the index's shards, else model.safetensors
    if not files:
        raise MlxExportError(f"{model_dir} has no model*.safetensors", "point at a model dir")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        tensors = load_file(str(f))
        refuse_twice(state.keys() & tensors.keys(), lambda k: _file_of(files, k), f)
        state.update(tensors)
    return state


def _file_of(files: list[Path], key: str) -> Path:
    """The first of `files` whose header holds `key` (only asked once, to name it)."""
    return next(f for f in files if key in read_header(f)[0])


def fused_to_hf(fused_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """An `mlx_lm.fuse` output (stacked `switch_mlp.*` experts) as a transformers
    checkpoint: transformers' own model is built from the config, given these weights
    (every tensor must find its place) and saved by transformers."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import AutoConfig

    src, out = Path(fused_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if "quantization" in config or "quantization_config" in config:
        raise MlxExportError(f"{src} is quantised", "fuse with `mlx_lm.fuse --dequantize` first")
    spec = spec_from_config(config, str(src))
    names = mlx_names(spec)
    if names.transposed:
        raise MlxExportError(
            f"{spec.model_type}: moetune does not rebuild transposed expert stacks from mlx",
            "merge the peft adapter in transformers instead (merge_and_unload)",
        )
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                     model_type=config["model_type"])  # fmt: skip
    with torch.device("meta"):
        model = causal_lm_class(hf_config)(hf_config)
    state = _hf_state(_read_weights(src), names)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (spec.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise MlxExportError(
            f"{src}: {len(missing)} transformers tensors not in the mlx weights "
            f"({missing[:2]}), {len(unexpected)} mlx tensors without a place ({unexpected[:2]})",
            "fuse with `mlx_lm.fuse --dequantize`, from a model moetune converted",
        )
    if spec.tie_word_embeddings:
        model.tie_weights()
    tmp = fresh_dir(out, overwrite)
    model.save_pretrained(str(tmp))
    for path in src.iterdir():
        if SIDE_FILES.fullmatch(path.name):
            shutil.copy(path, tmp / path.name)
    return commit_dir(tmp, out)


# ---------------------------------------------------------------- served == trained


def _relative(a: Any, b: Any) -> float:
    # lazy: heavy to import (numpy)
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(x - y)) / max(float(np.linalg.norm(y)), 1e-30)


def peft_logits(base_dir: str | Path, adapter_dir: str | Path, tokens: list[list[int]]) -> Any:
    """Logits of the peft adapter on `base_dir` in transformers (float32, CPU)."""
    # lazy: heavy to import (torch, peft, transformers)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def mlx_logits(mlx_dir: str | Path, adapter_dir: str | Path | None, tokens: list[list[int]]) -> Any:
    """Logits of the mlx-lm model (with its mlx-lm adapter) on the same tokens."""
    # lazy: heavy to import (mlx, numpy, mlx_lm)
    import mlx.core as mx  # type: ignore[import-not-found]
    import numpy as np
    from mlx_lm.utils import load  # type: ignore[import-not-found]

    model = load(str(mlx_dir), adapter_path=str(adapter_dir) if adapter_dir else None)[0]
    logits = model(mx.array(tokens)).astype(mx.float32)
    mx.eval(logits)
    return np.array(logits)


def served_matches_trained(
    base_dir: str | Path, adapter_dir: str | Path, tokens: list[list[int]],
    tolerance: float = 1e-4,
) -> dict[str, Any]:  # fmt: skip
    """Convert base and adapter for mlx-lm (float32) and compare its logits with peft's in
    transformers on `tokens`: relative norm of the difference, and whether it is within
    `tolerance`."""
    with tempfile.TemporaryDirectory() as tmp:
        mlx_base = hf_to_mlx(base_dir, Path(tmp) / "base", dtype="float32")
        mlx_adapter = peft_to_mlx(adapter_dir, Path(tmp) / "adapter", str(base_dir))
        served = mlx_logits(mlx_base, mlx_adapter, tokens)
    trained = peft_logits(base_dir, adapter_dir, tokens)
    rel = _relative(served, trained)
    return {"relative_error": rel, "tolerance": tolerance, "ok": rel <= tolerance}


def export_mlx(
    adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, *,
    tokens: list[list[int]] | None = None, overwrite: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The `mlx` export format: OUT/model (the base for mlx-lm), OUT/adapters (the adapter
    in mlx-lm's layout) – `mlx_lm.generate --model OUT/model --adapter-path OUT/adapters` –
    and the served == trained check on `tokens` (default: ids 1..16)."""
    src, out = Path(adapter_dir), Path(out_dir)
    base = base or read_json(src / PEFT_CONFIG)["base_model_name_or_path"]
    model = hf_to_mlx(base, out / "model", overwrite=overwrite)
    adapters = peft_to_mlx(src, out / "adapters", base, overwrite=overwrite)
    probe = tokens or [list(range(1, 17))]
    served = _relative(mlx_logits(model, adapters, probe), peft_logits(base, src, probe))
    check = {"relative_error": served, "tolerance": 1e-4, "ok": served <= 1e-4}
    return {"format": "mlx", "model": str(model), "adapters": str(adapters), "check": check}


# ---------------------------------------------------------------- `moetune export --format mlx`


def export_format(source: Any, out: Path, opts: Any) -> Any:
    """The registry's `mlx` entry: OUT/model and OUT/adapters, for
    `mlx_lm.generate --model OUT/model --adapter-path OUT/adapters`; the served == trained
    check runs through the mlx-lm consumer below on the run's eval items."""
    dtype = mlx_dtype(None if opts.dtype == "auto" else opts.dtype)  # float32 on mlx's CPU
    plain, stored = float_base(source, out / ".float-base")
    try:
        model = hf_to_mlx(plain, out / "model", dtype=dtype)
    finally:
        if stored:
            shutil.rmtree(plain, ignore_errors=True)
    adapters = peft_to_mlx(source.adapter_dir, out / "adapters", source.base)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    use = f"mlx_lm.generate --model {model.name} --adapter-path {adapters.name}"
    notes = [f"serve: {use} (paths inside --out)"]
    details = {"dtype": dtype or "bfloat16"}
    if stored:  # mlx-lm reads floats: the published FP8 / FP4 stacks, dequantised by moetune
        details["stored_base"] = stored
        notes.append(f"the base is stored as {stored}: the mlx model holds it dequantised")
    return ExportResult("mlx", out, files, notes, details=details)


def float_base(source: Any, stage: Path) -> tuple[str, str | None]:
    """The base as mlx-lm can convert it: itself, or – a base published quantised (block FP8,
    MXFP4, NVFP4 …), whose scales mlx-lm would refuse as unknown parameters – a float copy
    in `stage`, dequantised by moetune's own reader (what training read), with its tokenizer
    and config; (the dir, the stored format's name or None)."""
    # lazy: heavy to import (torch, transformers)
    import torch

    from moetune.export.merged import copy_code, copy_tokenizer, load_base
    from moetune.export.stored_base import stored_of

    found = stored_of(source.base)
    if found is None:
        return source.base, None
    load_base(source.base, torch.float32).save_pretrained(str(stage))
    copy_tokenizer(source, stage)
    copy_code(source.base, stage)
    return str(stage), found[0].name


def mlx_consumer(
    out: Path, source: Any, sequences: list[list[int]], prompts: list[list[int]], new: int
) -> Any:
    """The export as mlx-lm serves it: logits per sequence and greedy continuations."""
    # lazy: heavy to import (mlx, numpy, torch, mlx_lm, moetune.export)
    import mlx.core as mx  # type: ignore[import-not-found]
    import numpy as np
    import torch
    from mlx_lm.utils import load  # type: ignore[import-not-found]

    from moetune.export.check import Served, greedy

    model = load(str(out / "model"), adapter_path=str(out / "adapters"))[0]

    def logits(ids: list[int]) -> torch.Tensor:
        got = model(mx.array([ids])).astype(mx.float32)
        mx.eval(got)
        return torch.from_numpy(np.array(got)[0]).double()

    return Served(
        logits=[logits(s) for s in sequences],
        greedy=[greedy(lambda ids: logits(ids)[-1], p, new) for p in prompts],
    )


def _register() -> None:
    # lazy: heavy to import (moetune.export)
    from moetune.export.check import register_consumer

    register(Exporter("mlx", export_format, "mlx-lm model + adapter (switch_mlp layout)"))
    register_consumer("mlx", "mlx-lm", mlx_consumer)


_register()
