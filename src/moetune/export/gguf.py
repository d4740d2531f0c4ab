"""`--format gguf`: a llama.cpp LoRA whose expert LoRA uses llama.cpp's stacked layout.

llama.cpp applies LoRA to routed experts in `build_lora_mm_id`: two `ggml_mul_mat_id`
over `blk.N.ffn_{gate,up,down}_exps.weight.lora_a` / `.lora_b`, with (numpy order)
A `[E, r, in]` and B `[E, out, r]` – exactly peft's per-expert factors – and the scale
`adapter.lora.alpha / r` taken from B's rank. Its stock `convert_lora_to_gguf.py` stops on
peft's fused expert adapters (`Unprocessed experts`), so moetune writes the file itself
with the `gguf` package: attention / dense LoRA as A `[r, in]`, B `[out, r]`, the fused
gate_up stack split like llama.cpp's converter splits the weight (halves for most
families, interleaved even/odd rows for gpt-oss). Each layer's own peft scaling is folded
into B where it differs from the file-wide alpha / r, so rank patterns stay exact. Where the
converter permutes q/k rows into llama.cpp's rope layout (LLAMA: mixtral, granitemoe), B's
rows are permuted the same way, since permuting W's rows permutes B's in ΔW = B @ A.

Where llama.cpp's `convert_hf_to_gguf.py` is found (MOETUNE_LLAMA_CPP=<llama.cpp dir>),
the base and the merged model are converted too (base.gguf, merged.gguf).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moetune.errors import clip
from moetune.export.deltas import LoraTarget, expert_factors, iter_deltas
from moetune.export.registry import (
    Exporter,
    ExportError,
    ExportOptions,
    ExportResult,
    Source,
    register,
)
from moetune.model.families.serving import GGUF_FAMILIES, GgufFamily

ADAPTER_FILE = "adapter.gguf"


def family_of(base: str) -> GgufFamily:
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    if config.model_type not in GGUF_FAMILIES:
        known = ", ".join(sorted(GGUF_FAMILIES))
        raise ExportError(
            f"no GGUF tensor mapping for {config.model_type!r} (mapped: {known})",
            "export --format merged and convert it with llama.cpp's convert_hf_to_gguf.py",
        )
    family = GGUF_FAMILIES[config.model_type]
    if not family.permute_qk:
        return family
    text = config.get_text_config()
    n_head = int(text.num_attention_heads)
    n_kv = int(getattr(text, "num_key_value_heads", None) or n_head)
    return replace(family, heads=(n_head, n_kv))


def rope_rows(b: torch.Tensor, n_head: int) -> torch.Tensor:
    """B's rows in the order LLAMA's converter puts W's q/k rows: per head, the two rope
    halves interleaved. W's rows move, so B's rows do (ΔW = B @ A)."""
    rows = b.shape[0]
    if rows % (2 * n_head):
        raise ExportError(
            f"{rows} q/k rows do not split into {n_head} heads of two rope halves",
            "export --format merged",
        )
    return b.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(b.shape)


def permuted(param: str, b: torch.Tensor, family: GgufFamily) -> torch.Tensor:
    """B of an attention LoRA as llama.cpp's converted base needs it (q with n_head, k with
    n_head_kv, as conversion/llama.py permutes them); other weights unchanged."""
    if family.heads is None:
        return b
    n_head, n_kv = family.heads
    if param.endswith("q_proj.weight"):
        return rope_rows(b, n_head)
    if param.endswith("k_proj.weight"):
        return rope_rows(b, n_kv)
    return b


def refuse_unserved(param: str, family: GgufFamily) -> None:
    """A LoRA llama.cpp would drop (deepseek2's MLA projections) is refused, not written."""
    for module in family.unserved:
        if f".{module}." in param:
            raise ExportError(
                f"llama.cpp applies no LoRA to {module} in {family.arch} ({clip(param, 60)})",
                f"train without {module} in the LoRA targets, or export --format merged",
            )


def split_gate_up(b: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """B `[E, 2I, r]` of a fused gate_up stack as (gate, up), the way llama.cpp splits W."""
    if how == "interleaved":
        return b[:, 0::2], b[:, 1::2]
    half = b.shape[1] // 2
    return b[:, :half], b[:, half:]


def pieces(
    target: LoraTarget, a: torch.Tensor, b: torch.Tensor, family: GgufFamily
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(transformers weight name, A, B) in llama.cpp's orientation (W = B @ A per expert)."""
    if not target.is_experts:
        refuse_unserved(target.param, family)
        yield target.param, a, permuted(target.param, b, family)
        return
    per_a, per_b = expert_factors(target, a, b)
    stem, _, which = target.param.rpartition(".")
    if which == "gate_up_proj":
        gate, up = split_gate_up(per_b, family.gate_up)
        yield f"{stem}.gate_proj.weight", per_a, gate
        yield f"{stem}.up_proj.weight", per_a, up
    elif which in ("down_proj", "gate_proj", "up_proj"):
        yield f"{stem}.{which}.weight", per_a, per_b
    else:
        raise ExportError(
            f"no GGUF name for the expert stack {target.param}", "export --format merged"
        )


def rank_of(target: LoraTarget, a: torch.Tensor) -> int:
    return a.shape[0] // target.experts if target.is_experts else a.shape[0]


def lora_tensors(source: Source, family: GgufFamily) -> tuple[float, dict[str, Any]]:
    """(file-wide alpha, GGUF tensor name -> float32 numpy array) for the whole adapter."""
    # lazy: heavy to import (gguf)
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, _layers(source.base))
    alpha: float | None = None
    tensors: dict[str, Any] = {}
    for target, a, b in iter_deltas(source.adapter_dir, source.base, torch.float32):
        rank = rank_of(target, a)
        alpha = target.scaling * rank if alpha is None else alpha
        fold = target.scaling * rank / alpha  # llama.cpp scales by alpha / r
        for hf_name, pa, pb in pieces(target, a, b, family):
            if family.rename is not None:
                hf_name = hf_name.replace(*family.rename)
            name = names.get_name(hf_name, try_suffixes=(".weight",))
            if name is None:
                raise ExportError(
                    f"llama.cpp has no tensor for {clip(hf_name, 90)}", "export --format merged"
                )
            tensors[f"{name}.lora_a"] = pa.contiguous().numpy()
            tensors[f"{name}.lora_b"] = (pb * fold).contiguous().numpy()
    return float(alpha or 0.0), tensors


def _layers(base: str) -> int:
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    return int(config.get_text_config().num_hidden_layers)


def write_adapter(path: Path, family: GgufFamily, alpha: float, tensors: dict[str, Any]) -> None:
    # lazy: heavy to import (gguf)
    import gguf

    writer = gguf.GGUFWriter(
        str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)]
    )
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from MOETUNE_LLAMA_CPP, when it is there."""
    root = os.environ.get("MOETUNE_LLAMA_CPP")
    script = Path(root) / "convert_hf_to_gguf.py" if root else None
    return script if script is not None and script.is_file() else None


VOCAB_RUNNER = Path(__file__).with_name("gguf_vocab.py")


def convert(script: Path, model_dir: Path, outfile: Path) -> None:
    """Run llama.cpp's converter (float32, so the check compares the weights themselves)
    through gguf_vocab.py, which writes a character tokenizer's vocabulary the converter
    refuses (its pre-tokenizer hash is unknown to it) and leaves everything else to it."""
    cmd = [sys.executable, str(VOCAB_RUNNER), str(script.parent), str(model_dir), str(outfile)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ExportError(
            f"convert_hf_to_gguf.py failed on {model_dir.name}: {clip(last[0], 120)}",
            "see its output; or unset MOETUNE_LLAMA_CPP",
        )


def export_gguf(source: Source, out: Path, opts: ExportOptions) -> ExportResult:
    family = family_of(source.base)
    alpha, tensors = lora_tensors(source, family)
    write_adapter(out / ADAPTER_FILE, family, alpha, tensors)
    result = ExportResult(
        "gguf", out, details={"arch": family.arch, "alpha": alpha, "tensors": len(tensors)}
    )
    experts = sorted(n for n in tensors if "_exps." in n)
    result.details["expert_tensors"] = len(experts)
    script = converter()
    if script is None:
        result.notes.append(
            "llama.cpp's convert_hf_to_gguf.py not found (set MOETUNE_LLAMA_CPP=<llama.cpp "
            "dir>): only the LoRA was written; convert the base with it yourself"
        )
    else:
        convert_with_merge(script, source, out, opts)
    result.files = sorted(p.name for p in out.iterdir() if p.is_file())
    result.notes.append(f"serve: llama-cli -m base.gguf --lora {ADAPTER_FILE}  (or -m merged.gguf)")
    return result


def convert_with_merge(script: Path, source: Source, out: Path, opts: ExportOptions) -> None:
    """base.gguf (what the LoRA applies to) and merged.gguf through llama.cpp's converter."""
    # lazy: heavy to import (moetune.export)
    from moetune.export.merged import export_merged

    merged = out / "merged-hf"
    merged.mkdir()
    export_merged(source, merged, opts.model_copy(update={"dtype": "float32"}))
    convert(script, Path(source.base), out / "base.gguf")
    convert(script, merged, out / "merged.gguf")


register(Exporter("gguf", export_gguf, "llama.cpp LoRA (stacked *_exps experts) + merged GGUF"))
import moetune.export.llamacpp  # noqa: E402,F401  (registers the llama.cpp consumer of gguf)
