"""peft <-> mlx-lm adapter layouts, and mlx-lm adapters as peft adapters (`mlx_to_peft`).

The mlx stack (train/mlx/stack.py) trains with mlx-lm and hands back a peft adapter through
`mlx_to_peft`; moetune.export.mlx holds the other directions.

Layouts (docs/knowledge.md §3, §5):
- peft, a fused expert stack (ParamWrapper): A `[E·r, in]` viewed `(E, r, in)`, B `[out, E·r]`
  viewed `(out, r, E)` (expert index fastest); ΔW_e = s · B_e @ A_e in `(out, in)`
  orientation whatever the stack's storage. gate_up_proj holds gate and up as halves (or
  interleaved `[::2]`/`[1::2]`, gpt_oss). Two parameters of one module nest: the first in
  the adapter config's `target_parameters` is the inner `base_layer`.
- mlx-lm, `LoRASwitchLinear` per projection: `lora_a (E, r, in)`, `lora_b (E, out, r)`;
  `LoRALinear`: `lora_a (in, r)`, `lora_b (r, out)`; one `rank` and one direct `scale`
  for the whole adapter (peft: alpha/r per module).
So peft -> mlx splits B's rows into gate and up (same A, exact), and mlx -> peft stacks
gate and up into a rank-2r block-diagonal gate_up (exact). Both directions recognise the
other's construction and undo it, so round trips give the original tensors back. Ranks or
scales that differ per module are padded with zeros / folded into B (exact).

`mlx_lm.fuse` writes stacked `switch_mlp.*` expert keys that transformers 5 loads without
error but with random experts (MLX-FUSED-KEYS); `fused_to_hf` rebuilds transformers' own
model from them and lets transformers save its checkpoint layout.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.errors import MoetuneError
from moetune.model import ModelSpec, get_family, load_spec
from moetune.train.rundir.checkpoint import replace_dir

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
MLX_WEIGHTS, MLX_CONFIG = "adapters.safetensors", "adapter_config.json"
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_KEY = re.compile(
    r"^(?P<layers>.+\.layers)\.(?P<i>\d+)\.(?P<rel>.+?)\.(?P<nest>(?:base_layer\.)*)"
    r"lora_(?P<ab>[AB])\.weight$"
)
MLX_KEY = re.compile(r"^(?P<layers>.+\.layers)\.(?P<i>\d+)\.(?P<rel>.+)\.lora_(?P<ab>[ab])$")


class MlxFormatError(MoetuneError):
    """An adapter or model that cannot be converted between peft and mlx-lm."""


# ---------------------------------------------------------------- names per family


@dataclass(frozen=True)
class MlxNames:
    """Layer-relative names of one model in transformers/peft and in mlx-lm."""

    linears: dict[str, str]  # HF Linear path -> mlx path where they differ (dense, shared)
    stacks: dict[str, tuple[str, ...]]  # HF fused expert parameter -> mlx switch paths
    blocks: tuple[str, str]  # the MoE block: (HF, mlx), e.g. ("mlp", "block_sparse_moe")
    interleaved: bool  # gate/up interleaved in gate_up_proj (gpt_oss) instead of halves
    transposed: bool = False  # transformers stores the stacks [E, in, out] (gpt_oss)

    def to_mlx(self, rel: str) -> str:
        if rel in self.linears:
            return self.linears[rel]
        hf, mlx = self.blocks
        return mlx + rel[len(hf) :] if rel.startswith(hf + ".") else rel

    def to_hf(self, rel: str) -> str:
        back = {v: k for k, v in self.linears.items()}
        if rel in back:
            return back[rel]
        hf, mlx = self.blocks
        return hf + rel[len(mlx) :] if rel.startswith(mlx + ".") else rel


def mlx_names(spec: ModelSpec) -> MlxNames:
    """The name map of `spec`'s family; refuses families mlx-lm has no SwitchGLU for."""
    family = get_family(spec.model_type)
    layout, paths = family.layout, family.paths_of(spec)
    if not family.mlx_supported or layout.flat_2d or not layout.fused_gate_up:
        raise MlxFormatError(
            f"{spec.name}: moetune has no mlx-lm layout for the {spec.model_type} family",
            "use the peft adapter with transformers, or export a merged model",
        )
    linears = {k: v for k, v in _pairs(paths.dense_mlp, paths.mlx_dense) if k != v}
    linears |= {k: v for k, v in _pairs(paths.shared, paths.mlx_shared) if k != v}
    stacks: dict[str, tuple[str, ...]] = {}
    if paths.expert_params and paths.mlx_experts:
        gate_up, down = paths.expert_params
        gate, up, mlx_down = paths.mlx_experts
        stacks = {gate_up: (gate, up), down: (mlx_down,)}
    hf_block = paths.expert_params[0].rsplit(".experts", 1)[0] if stacks else "mlp"
    mlx_block = paths.mlx_experts[0].rsplit(".", 2)[0] if stacks else "mlp"
    blocks = (hf_block, mlx_block)
    return MlxNames(linears, stacks, blocks, not layout.is_concatenated, layout.is_transposed)


def _pairs(a: tuple[str, ...], b: tuple[str, ...]) -> list[tuple[str, str]]:
    return list(zip(a, b, strict=True)) if len(a) == len(b) else []


# ---------------------------------------------------------------- file helpers


def fresh_dir(out_dir: Path, overwrite: bool) -> Path:
    """A temp dir beside `out_dir`; an existing `out_dir` is an error unless `overwrite`."""
    if out_dir.exists() and not overwrite:
        raise MlxFormatError(
            f"{out_dir} already exists", "choose a new output dir (or pass overwrite=True)"
        )
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, out_dir: Path) -> Path:

    replace_dir(tmp, out_dir)
    return out_dir


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MlxFormatError(f"{path} does not exist", "point at the adapter or model directory")
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    # lazy: heavy to import (safetensors)
    from safetensors.torch import load_file

    if not path.is_file():
        raise MlxFormatError(f"{path} does not exist", "point at the adapter directory")
    return {k: v.float() for k, v in load_file(str(path)).items()}


# ---------------------------------------------------------------- mlx -> peft


def _mlx_factors(tensors: dict[str, torch.Tensor]) -> dict[tuple[str, int], dict[str, dict]]:
    """(layers prefix, layer) -> mlx module -> {"a": …, "b": …}."""
    found: dict[tuple[str, int], dict[str, dict]] = {}
    for key, value in tensors.items():
        match = MLX_KEY.match(key)
        if match is None:
            raise MlxFormatError(
                f"mlx adapter tensor {key} is not a LoRA factor",
                "convert LoRA adapters (fine_tune_type lora; DoRA and full fine-tunes are not)",
            )
        layer = found.setdefault((match["layers"], int(match["i"])), {})
        layer.setdefault(match["rel"], {})[match["ab"]] = value
    return found


def _join_gate_up(gate: dict | None, up: dict | None, names: MlxNames) -> tuple[Any, Any]:
    """mlx gate and up factors -> one gate_up (a (E, r, in), b (E, out, r)): a shared `a`
    (what peft_to_mlx writes) stays rank r, else a rank-2r block diagonal."""
    # lazy: heavy to import (torch)
    import torch

    ref = gate or up
    assert ref is not None
    zero = {"a": torch.zeros_like(ref["a"]), "b": torch.zeros_like(ref["b"])}
    g, u = gate or zero, up or zero
    rows = g["b"].shape[1] + u["b"].shape[1]
    gate_rows = slice(0, rows, 2) if names.interleaved else slice(0, rows // 2)
    up_rows = slice(1, rows, 2) if names.interleaved else slice(rows // 2, rows)
    r = g["a"].shape[1]
    shared = gate is not None and up is not None and torch.equal(g["a"], u["a"])
    b = g["b"].new_zeros(g["b"].shape[0], rows, r if shared else 2 * r)
    b[:, gate_rows, :r] = g["b"]
    b[:, up_rows, (0 if shared else r) :] = u["b"]
    return (g["a"] if shared else torch.cat([g["a"], u["a"]], dim=1)), b


def _peft_stack(a: Any, b: Any) -> tuple[Any, Any]:
    """(E, r, in), (E, out, r) -> peft's A [E·r, in], B [out, r·E] (expert index fastest)."""
    experts, r, inner = a.shape
    return a.reshape(experts * r, inner), b.permute(1, 2, 0).reshape(b.shape[1], r * experts)


def _peft_tensors(
    factors: dict[tuple[str, int], dict[str, dict]], names: MlxNames
) -> tuple[dict[str, Any], dict[str, int], set[str], set[str]]:
    """peft tensors, the rank of each stack parameter, the Linear paths, the stacks used."""
    tensors: dict[str, Any] = {}
    stack_rank: dict[str, int] = {}
    linears: set[str] = set()
    params = list(names.stacks)
    for (layers, i), modules in factors.items():
        prefix = f"{PEFT_PREFIX}{layers}.{i}."
        claimed: set[str] = set()
        for k, (param, targets) in enumerate(names.stacks.items()):
            got = [modules.get(t) for t in targets]
            if not any(got):
                continue
            claimed |= set(targets)
            a, b = _join_gate_up(got[0], got[1], names) if len(targets) == 2 else (
                got[0]["a"], got[0]["b"])  # type: ignore[index]  # fmt: skip
            stack_rank[param] = a.shape[1]
            nest = "base_layer." * (len(params) - 1 - k)
            module = prefix + param.rsplit(".", 1)[0] + "." + nest
            tensors[module + "lora_A.weight"], tensors[module + "lora_B.weight"] = _peft_stack(a, b)
        for rel, ab in modules.items():
            if rel in claimed:
                continue
            hf = names.to_hf(rel)
            linears.add(hf)
            tensors[f"{prefix}{hf}.lora_A.weight"] = ab["a"].T.contiguous()
            tensors[f"{prefix}{hf}.lora_B.weight"] = ab["b"].T.contiguous()
    return tensors, stack_rank, linears, set(stack_rank)


def mlx_to_peft(
    adapter_dir: str | Path, out_dir: str | Path, base: str, *, overwrite: bool = False
) -> Path:
    """An mlx-lm LoRA adapter dir as a peft adapter for the HF model `base` (loads with plain
    `PeftModel.from_pretrained`, same ΔW)."""
    # lazy: heavy to import (peft, safetensors)
    from peft import LoraConfig
    from safetensors.torch import save_file

    src, out = Path(adapter_dir), Path(out_dir)
    config = read_json(src / MLX_CONFIG)
    params = config.get("lora_parameters") or {}
    if config.get("fine_tune_type", "lora") != "lora" or "scale" not in params:
        raise MlxFormatError(
            f"{src} is not an mlx-lm LoRA adapter (fine_tune_type "
            f"{config.get('fine_tune_type')!r})",
            "convert adapters trained with fine_tune_type: lora",
        )
    spec, scale = load_spec(base), float(params["scale"])
    names = mlx_names(spec)
    factors = _mlx_factors(load_tensors(src / MLX_WEIGHTS))
    tensors, stack_rank, linears, stacks = _peft_tensors(factors, names)
    rank = int(params["rank"])
    attention = sorted(p for p in linears if p.startswith("self_attn."))
    weights = sorted(f"{p}.weight" for p in linears if not p.startswith("self_attn."))
    layers = sorted({i for _, i in factors})
    lora = LoraConfig(
        r=rank,
        lora_alpha=_num(scale * rank),
        lora_dropout=0.0,
        target_modules=attention or None,
        # stacks first, in the family's order: that order decides the nesting peft loads
        target_parameters=[p for p in names.stacks if p in stacks] + weights or None,
        rank_pattern={p: r for p, r in stack_rank.items() if r != rank},
        alpha_pattern={p: _num(scale * r) for p, r in stack_rank.items() if r != rank},
        layers_to_transform=layers if len(layers) < spec.num_layers else None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    tmp = fresh_dir(out, overwrite)
    lora.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / PEFT_WEIGHTS))
    return commit_dir(tmp, out)


def _num(value: float) -> Any:
    return int(value) if float(value).is_integer() else value
