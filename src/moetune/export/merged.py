"""`--format merged`: the base with every LoRA ΔW added, saved by transformers itself.

One copy of the model in memory: the base is loaded in the target dtype, each layer's ΔW
is computed from the adapter's A/B in float32 and added to its parameter in place (one
parameter's temporary at a time), and `save_pretrained` writes shard by shard in the
on-disk layout transformers uses for the family (fused expert stacks split back into
`experts.N.*` keys where the checkpoint format has them). A ΔW on a tied weight (an adapted
lm_head sharing the embedding) cannot be represented by one tensor and is refused.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moetune.errors import clip
from moetune.export.deltas import iter_deltas
from moetune.export.registry import (
    Exporter,
    ExportError,
    ExportOptions,
    ExportResult,
    Source,
    register,
)
from moetune.export.stored_base import export_requantized, load_dequantized, stored_of
from moetune.model.derive import checkpoint_class
from moetune.model.remote import code_files
from moetune.model.weight_files import checkpoint_files

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def resolve_dtype(base: str, requested: str) -> torch.dtype:
    """`requested`, or for auto the dtype the base's config.json states, else the one its
    safetensors hold (bf16 when neither says); bf16 for a base stored quantised."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ExportError(
                f"unknown dtype {requested!r}", f"use auto or one of {', '.join(DTYPES)}"
            )
        return DTYPES[requested]
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    if stored_of(base) is not None:
        return torch.bfloat16  # what its publishers compute in; its weights are not floats
    stated = getattr(AutoConfig.from_pretrained(base), "dtype", None)
    if stated is None:
        return _stored_dtype(base) or torch.bfloat16
    return DTYPES.get(str(stated).removeprefix("torch."), torch.bfloat16)


_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _stored_dtype(base: str) -> torch.dtype | None:
    """The float dtype of the first tensor of a local base's first safetensors file (a
    config.json without `dtype` says nothing; merging fp32 weights into bf16 loses ΔW)."""
    files = checkpoint_files(base) if Path(base).is_dir() else []
    if not files:
        return None
    # lazy: heavy to import (safetensors)
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:
        stored = (_STORED.get(f.get_slice(k).get_dtype()) for k in f.keys())  # noqa: SIM118
        return next((d for d in stored if d is not None), None)


def load_base(base: str, dtype: torch.dtype) -> Any:
    """The base's causal LM with its real weights; refuses a checkpoint with missing tensors.
    A base stored quantised is read by moetune and its expert stacks dequantised (never by
    transformers, which dequantises FP8 silently on a CPU and refuses MXFP4 training)."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    if stored_of(base) is not None:
        return load_dequantized(base, dtype)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = checkpoint_class(AutoConfig.from_pretrained(base))
        model, info = cls.from_pretrained(base, dtype=dtype, output_loading_info=True)
    if info["missing_keys"]:
        raise ExportError(
            f"the base {clip(base, 60)} lacks {len(info['missing_keys'])} tensors it builds",
            "point --base at the checkpoint the adapter was trained on",
        )
    if getattr(model, "hf_quantizer", None) is not None:  # bitsandbytes: its own dequantise
        model = model.dequantize(dtype=dtype)  # ΔW goes into float weights, saved unquantised
    return model.eval()


def tied_names(model: Any) -> dict[str, list[str]]:
    """Parameter name -> the other names sharing its storage (tied embeddings)."""
    by_ptr: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(param.data_ptr(), []).append(name)
    return {
        n: [o for o in names if o != n]
        for names in by_ptr.values()
        for n in names
        if len(names) > 1
    }


def merge_into(model: Any, source: Source) -> dict[str, Any]:
    """Add every ΔW of the adapter to `model` in place; counts of what was merged."""
    tied = tied_names(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    counts = {"layers": 0, "expert_layers": 0, "delta_norm": 0.0, "expert_delta_norm": 0.0}
    with torch.no_grad():
        for target, a, b in iter_deltas(source.adapter_dir, source.base, torch.float32):
            if target.param in tied:
                raise ExportError(
                    f"{target.param} is tied to {tied[target.param][0]}: one merged tensor "
                    "cannot hold both",
                    "train without LoRA on tied embeddings / lm_head, or untie them first",
                )
            add_delta(params[target.param], target, a, b, counts)
    return counts


def add_delta(
    param: torch.nn.Parameter, target: Any, a: torch.Tensor, b: torch.Tensor, counts: dict[str, Any]
) -> None:
    # lazy: heavy to import (moetune.export)
    from moetune.export.deltas import delta

    d = delta(target, a, b)
    if d.shape != param.shape:
        raise ExportError(
            f"ΔW of {target.param} is {tuple(d.shape)}, the parameter {tuple(param.shape)}",
            "export with the base the adapter was trained on (--base)",
        )
    param.copy_((param.float() + d).to(param.dtype))
    norm = float(d.norm())
    counts["layers"] += 1
    counts["delta_norm"] += norm
    if target.is_experts:
        counts["expert_layers"] += 1
        counts["expert_delta_norm"] += norm


def copy_tokenizer(source: Source, out: Path) -> list[str]:
    """Tokenizer files from the base's tokenizer dir (or, failing that, the adapter dir)
    into `out`."""
    return _copy_present((Path(source.tokenizer_dir), source.adapter_dir), TOKENIZER_FILES, out)


def copy_code(base: str, out: Path) -> list[str]:
    """The modeling files a remote-code base ships (its config.json's auto_map names them):
    the merged config.json keeps that auto_map, so without them nothing can load it."""
    config = Path(base) / "config.json"
    if not config.is_file():
        return []
    names = code_files(json.loads(config.read_text(encoding="utf-8")))
    return _copy_present((Path(base),), names, out)


def _copy_present(folders: Sequence[Path], names: Sequence[str], out: Path) -> list[str]:
    """Each named file found in the first folder that has it, into `out` (never over one
    already there); the names copied."""
    copied = []
    for folder in folders:
        for name in names:
            if (folder / name).is_file() and not (out / name).exists():
                shutil.copy2(folder / name, out / name)
                copied.append(name)
    return copied


def saved_layout(folder: Path) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, dtype) of every file of the checkpoint in `folder` (headers)."""
    # lazy: heavy to import (safetensors)
    from safetensors import safe_open

    layout = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has no __contains__/__iter__)
                sl = f.get_slice(key)
                layout[key] = (list(sl.get_shape()), str(sl.get_dtype()))
    return layout


def export_merged(source: Source, out: Path, opts: ExportOptions) -> ExportResult:
    dtype = resolve_dtype(source.base, opts.dtype)
    stored, survival = stored_of(source.base), None
    if opts.extra.get("requantize"):
        counts, survival = export_requantized(source, out, opts, dtype, merge_into)
    else:
        counts = write_merged(source, out, opts, dtype)
    tokenizer = copy_tokenizer(source, out)
    code = copy_code(source.base, out)
    result = ExportResult("merged", out, files=sorted(p.name for p in out.iterdir()))
    result.details = {"dtype": str(dtype).removeprefix("torch."), **counts, "tokenizer": tokenizer}
    result.details["layout"] = layout_vs_base(source.base, out, bool(stored) and survival is None)
    if stored:
        result.details["stored_base"] = stored[0].name
        result.details["requantized"] = survival is not None
    if survival is not None:
        result.details["survival"] = survival
    if code:
        result.details["code"] = code
    if not tokenizer:
        result.notes.append("no tokenizer files next to the base or the adapter: copy them in")
    return result


def write_merged(
    source: Source, out: Path, opts: ExportOptions, dtype: torch.dtype
) -> dict[str, Any]:
    """The base with ΔW added, saved by transformers in `dtype`; the merge counts."""
    model = load_base(source.base, dtype)
    counts = merge_into(model, source)
    model.save_pretrained(str(out), max_shard_size=opts.max_shard_size)
    return counts


def layout_vs_base(base: str, out: Path, unquantised: bool = False) -> dict[str, Any]:
    """Whether the merged files hold exactly the base checkpoint's tensor names and shapes
    (not compared when a quantised base was written unquantised: its scales are gone)."""
    if unquantised or not Path(base).is_dir() or not checkpoint_files(base):
        return {"compared": False}
    mine, theirs = saved_layout(out), saved_layout(Path(base))
    same_shapes = all(mine[k][0] == theirs[k][0] for k in mine.keys() & theirs.keys())
    return {
        "compared": True, "same_names": mine.keys() == theirs.keys(), "same_shapes": same_shapes,
        "only_merged": sorted(mine.keys() - theirs.keys())[:5],
        "only_base": sorted(theirs.keys() - mine.keys())[:5],
    }  # fmt: skip


register(
    Exporter("merged", export_merged, "the base with the LoRA merged in (transformers layout)")
)
