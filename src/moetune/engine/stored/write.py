"""Write a float checkpoint in a published quantised layout, as its publishers ship it.

Tiny published-layout checkpoints for the tests, and large ones for the benchmarks: a
transformers-saved float checkpoint is rewritten tensor by tensor (never the whole model in
memory), expert weights per expert (`mlp.experts.<e>.gate_proj.weight` + its scales) or
fused as the family saves them (gpt-oss: `<proj>_blocks` / `<proj>_scales` in the stored
[E, out, in] order), the other Linears quantised too where the format's publishers do
(DeepSeek's FP8 attention, dense and shared MLP), sharded with `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moetune.engine.quant.stacks import QUANTIZERS, QuantError, experts_modules, is_transposed
from moetune.engine.stored.formats import StoredFormat, published_quantised
from moetune.model.derive import causal_lm_class
from moetune.model.weight_files import checkpoint_files

_PER_EXPERT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")


def write_stored(
    src: str | Path, out: str | Path, method: str, *, rest: bool | None = None,
    shard_bytes: int = 2**30, dtype: torch.dtype | None = None, **options: Any,
) -> Path:  # fmt: skip
    """`src` (config.json + *.safetensors, float) rewritten under `out` stored as `method`.

    `rest`: quantise the non-expert Linears too (default: the format's publishers' habit).
    `options` go to the format's `quantize` and `config` (fp8 `block`, int4 `group`).
    `dtype`: the float tensors left unquantised are written in it (default: as in `src`).
    """
    fmt = QUANTIZERS.get(method)
    if not fmt.stored:
        raise QuantError(
            f"{method!r} is not a published storage format",
            "use fp8, fp8_scaled, mxfp4, nvfp4 or int4",
        )
    assert issubclass(fmt, StoredFormat)
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    fused = _fused_stacks(src)
    rest = (not fmt.experts_only) if rest is None else rest
    out.mkdir(parents=True, exist_ok=True)
    shards = Shards(out, shard_bytes)
    for key, tensor in _tensors(src):
        for name, value in _convert(fmt, key, tensor, fused, rest, options).items():
            kept = value is tensor and dtype is not None and value.is_floating_point()
            shards.add(name, value.to(dtype) if kept else value)
    shards.close()
    config["quantization_config"] = fmt.config(**options)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():  # tokenizer, chat template, generation config
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json"):  # fmt: skip
            shutil.copy2(extra, out / extra.name)
    return out


def _fused_stacks(src: Path) -> dict[str, bool]:
    """Checkpoint key of every fused 3-D expert stack -> whether it is stored [E, in, out]."""
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    with init_empty_weights():
        model = causal_lm_class(config)._from_config(config)
    return {f"{path}.{n}": is_transposed(m) for path, m, names in experts_modules(model)
            for n in names}  # fmt: skip


def _tensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # lazy: heavy to import
    from safetensors import safe_open

    for file in checkpoint_files(src):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle)
                yield key, f.get_tensor(key)


def _convert(fmt: type[StoredFormat], key: str, tensor: torch.Tensor, fused: dict[str, bool],
             rest: bool, options: dict[str, Any]) -> dict[str, torch.Tensor]:  # fmt: skip
    """One float tensor -> the tensors the published checkpoint holds for it."""
    if key in fused and tensor.ndim == 3:
        canonical = tensor.transpose(1, 2) if fused[key] else tensor
        bufs = fmt.quantize(canonical.contiguous(), **options)
        return {f"{key}{fused_suffix}": bufs[b].contiguous()
                for b, (_, fused_suffix) in fmt.keys.items()}  # fmt: skip
    expert = bool(_PER_EXPERT.search(key))
    linear = rest and tensor.ndim == 2 and key.endswith(".weight") and published_quantised(key)
    if not (expert or linear):
        return {key: tensor}
    base = key.removesuffix(".weight")
    try:
        bufs = fmt.quantize(tensor[None], **options)
    except QuantError:
        if expert:
            raise
        return {key: tensor}  # a Linear the blocks do not divide stays float, as published
    return {f"{base}.{suffix}": _one(bufs[b][0]) for b, (suffix, _) in fmt.keys.items()}


def _one(value: torch.Tensor) -> torch.Tensor:
    """A per-Linear second-level scale is a scalar in the published files."""
    return value.reshape(()) if value.numel() == 1 and value.ndim == 1 else value.contiguous()


class Shards:
    """Tensors into model-0000k-of-0000n.safetensors of at most `limit` bytes, and the index;
    `written` sees each file once written (a benchmark drops it from the page cache)."""

    def __init__(self, out: Path, limit: int,
                 written: Callable[[Path], None] | None = None) -> None:  # fmt: skip
        self.out, self.limit, self.written = out, limit, written
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.total = 0, 0
        self.files: list[Path] = []
        self.where: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.size + tensor.nbytes > self.limit:
            self._flush()
        self.pending[name] = tensor
        self.size += tensor.nbytes
        self.total += tensor.nbytes

    def _flush(self) -> None:
        # lazy: heavy to import
        from safetensors.torch import save_file

        path = self.out / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        if self.written is not None:
            self.written(path)
        self.where.update(dict.fromkeys(self.pending, len(self.files)))
        self.files.append(path)
        self.pending, self.size = {}, 0

    def close(self) -> int:
        """The last file, every file's final name and the index; the bytes written."""
        if self.pending:
            self._flush()
        n = len(self.files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self.files, names, strict=True):
            path.rename(self.out / name)
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {k: names[i] for k, i in sorted(self.where.items())}}  # fmt: skip
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return self.total
