"""Expert stacks as a checkpoint stores them: FP8, MXFP4, NVFP4, INT4 (docs/knowledge.md §14).

Each published format is a `Quantizer` in engine/quant/stacks.py's registry, beside int8 /
NF4, one module a format (fp8.py, mxfp4.py, nvfp4.py, int4.py, each registered when
moetune.engine imports it), with the trait `stored`: its buffers are the checkpoint's own
tensors, read as they are (engine/stored/load.py), never made from a float stack. Buffers
keep a leading expert dim and a canonical [out, in] order, so `QuantizedStack` slices one
expert and dequantises it alone (the split-LoRA forward and backward); per-expert checkpoint
tensors of the projections fused into one stack (gate + up) are concatenated along the
output rows, scale grids with them. A group size is read off the buffers' shapes (weight
columns / scale columns) where it must divide; block FP8's block size is config.json's
`weight_block_size` (its grid is ceil-divided, so the buffers cannot tell it): the format's
class configured with it (`configured`) is the stack's backend.

Dequantisation matches each format's reference bit for bit (tests/test_engine_stored.py):
DeepSeek's `weight_dequant` (block FP8; tests/test_stored_fp8_deepseek.py), transformers'
`_convert_moe_packed_tensors`, ModelOpt's NVFP4 formula,
compressed-tensors' int4 unpacking. `quantize` writes the same layout from float weights
(tiny published-layout checkpoints, the benchmarks); round to nearest as the publishers do.
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QUANTIZERS, QuantError, Quantizer
from moetune.model.hf_config import quant_config_of
from moetune.model.sources import resolve_config

Buffers = dict[str, torch.Tensor]
# no stored format keeps its codes in these (its scales, yes)
WIDE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (FP8 scales, NVFP4's second level)


class StoredFormat(Quantizer):
    """A published checkpoint format of expert (and other Linear) weights.

    `keys`: buffer name -> (suffix of a per-expert / per-Linear key after the projection,
    suffix appended to a fused stack's key). `scales`: the buffers that hold scales (checked
    finite and non-zero). `bytes_per_param` is what the planner asks; it never names a format.
    """

    stored = True
    experts_only: ClassVar[bool] = False  # publishers leave the other Linears in float
    label: ClassVar[str]  # how a person names it: "block FP8 (e4m3, 128x128 scales)"
    keys: ClassVar[dict[str, tuple[str, str]]]
    scales: ClassVar[tuple[str, ...]]

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        """Whether a config.json `quantization_config` is stored in this format."""
        raise NotImplementedError

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        raise NotImplementedError

    @classmethod
    def config(cls, **options: Any) -> dict[str, Any]:
        """The `quantization_config` a publisher writes for this format (tiny checkpoints)."""
        raise NotImplementedError

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        """The `quantize` / `config` options that reproduce a checkpoint's blocks or groups."""
        return {}

    @classmethod
    def weight_suffix(cls) -> str:
        """The per-Linear key suffix of the packed weight (first of `keys`)."""
        return next(iter(cls.keys.values()))[0]

    @classmethod
    def check(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int], where: str) -> None:
        """Refuse mis-shaped buffers and (real ones) NaN / Inf / zero scales, naming the tensor."""
        for name, shape in cls.shapes(buffers, out_in).items():
            got = tuple(buffers[name].shape[1:])
            if got != shape:
                raise QuantError(
                    f"{where}: {cls.name} tensor {name!r} is {list(got)}, expected {list(shape)} "
                    f"for a [{out_in[0]}, {out_in[1]}] weight",
                    "use the config.json published with these weights (or re-download them)",
                )
        for name, buf in buffers.items():  # codes are integers or fp8: a float is another file
            if name not in cls.scales and buf.dtype in WIDE_FLOATS:
                raise QuantError(f"{where}: {cls.name} tensor {name!r} is "
                                 f"{str(buf.dtype).removeprefix('torch.')}, where the format "
                                 "stores codes (integers or fp8), so its values would be "
                                 "misread", "use the checkpoint as published (a float file "
                                 "with these keys belongs to another release)")  # fmt: skip
        for name in cls.scales:
            if not cls.scale_dtype_ok(buffers[name]):  # an int read as a float is silently wrong
                raise QuantError(f"{where}: {cls.name} scales {name!r} are "
                                 f"{str(buffers[name].dtype).removeprefix('torch.')}, not the "
                                 "format's scale type", "use the checkpoint as published "
                                 "(its scales were converted or are corrupt)")  # fmt: skip
            if buffers[name].is_meta:
                continue
            values = cls.scale_values(name, buffers[name])
            if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
                raise QuantError(f"{where}: {cls.name} scales {name!r} hold NaN, Inf or zero "
                                 "(or negative) values",
                                 "re-download the checkpoint: its scales are corrupt")  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Each buffer's per-expert shape for an [out, in] weight (block sizes from the buffers)."""
        raise NotImplementedError

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return scale.float()

    @classmethod
    def scale_dtype_ok(cls, scale: torch.Tensor) -> bool:
        """Whether a scale tensor's dtype is one the format stores scales in (float here)."""
        return scale.is_floating_point()


# what publishers leave in float beside a quantised checkpoint's Linears (key fragments)
PUBLISHED_FLOAT = ("embed_tokens", "lm_head", ".gate.", ".router.", "norm")


def published_quantised(key: str) -> bool:
    """Whether publishers quantise the Linear weight at `key` (a state-dict key or a module
    path): not the embeddings, lm_head, norms or the router."""
    return not any(k in f"{key}." for k in PUBLISHED_FLOAT)


def kept_float(qcfg: dict[str, Any], module: str) -> bool:
    """Whether a checkpoint's own lists leave the Linear at `module` unquantised, each read as
    its writer reads it: compressed-tensors' `ignore` (an exact name, or a `re:` pattern
    matched from the start: its match_name), ModelOpt's `exclude_modules` (fnmatch wildcards,
    a listed module covering its children), transformers' `modules_to_not_convert` (a regex
    from the start up to a module boundary, or a suffix: its should_convert_module)."""
    for entry in map(str, qcfg.get("ignore") or ()):
        if re.match(entry[3:], module) if entry.startswith("re:") else entry == module:
            return True
    for entry in map(str, qcfg.get("exclude_modules") or ()):
        if fnmatch.fnmatchcase(module, entry) or fnmatch.fnmatchcase(module, f"{entry}.*"):
            return True
    return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p)
               for p in map(str, qcfg.get("modules_to_not_convert") or ()))  # fmt: skip


def stored_formats() -> list[type[StoredFormat]]:
    return [q for _, q in QUANTIZERS.items() if q.stored]  # type: ignore[misc]


def stored_format(qcfg: dict[str, Any] | None) -> type[StoredFormat] | None:
    """The format a checkpoint's `quantization_config` stores its weights in (None: float).
    Decided once per process for each quantization_config (the plan, the rules and the
    loader all ask), a QuantError included."""
    if not qcfg:
        return None
    key = json.dumps(qcfg, sort_keys=True, default=str)
    if key not in _FORMATS:
        try:
            _FORMATS[key] = decide_format(qcfg)
        except QuantError as exc:
            _FORMATS[key] = exc
    found = _FORMATS[key]
    if isinstance(found, QuantError):
        raise QuantError(found.cause, found.fix)
    return found


_FORMATS: dict[str, type[StoredFormat] | QuantError | None] = {}


def decide_format(qcfg: dict[str, Any]) -> type[StoredFormat] | None:
    """The decision itself (stored_format keeps it for the process)."""
    check_config_groups(qcfg)
    for fmt in stored_formats():
        if fmt.reads(qcfg):  # configured: its block size is the config's, never the grid's
            return fmt.configured(**fmt.options(qcfg))  # type: ignore[return-value]
    if transformers_trains(qcfg):
        needs = missing_library(qcfg)
        if needs:  # else transformers' loader ends in an ImportError after the plan said fits
            raise QuantError(f"a base quantised as {describe(qcfg)} needs a library that is "
                             f"not installed here: {needs}",
                             "install it as named, or use the base's bf16 release")  # fmt: skip
        return None  # bitsandbytes, GPTQ …: transformers' own quantizer trains it as before
    raise QuantError(f"moetune cannot read checkpoints quantised as {describe(qcfg)}",
                     f"use one stored as {', '.join(f.label for f in stored_formats())}, "
                     "or its bf16 release")  # fmt: skip


def base_format(model_id: str) -> tuple[type[StoredFormat], dict[str, Any]] | None:
    """(format, quantization_config) a base is published in – a local dir, a bundled or a hub
    id, by its config.json – or None for a float one; QuantError for one moetune cannot read."""
    _, raw = resolve_config(model_id)
    qcfg = quant_config_of(raw)
    fmt = stored_format(qcfg)
    return None if fmt is None else (fmt, qcfg)


def transformers_trains(qcfg: dict[str, Any]) -> bool:
    """Whether the installed transformers' own quantizer for `qcfg` trains (its
    `is_trainable`, on this machine's libraries); any failure to tell counts as no."""
    # lazy: heavy to import (transformers)
    from transformers.quantizers.auto import AutoHfQuantizer

    try:
        return bool(AutoHfQuantizer.from_config(dict(qcfg), pre_quantized=True).is_trainable)
    except Exception:  # a missing library, an unknown method: it cannot train here
        return False


def missing_library(qcfg: dict[str, Any]) -> str | None:
    """What transformers' own quantizer for `qcfg` says is not installed (its
    `validate_environment`'s ImportError, one line), or None. Its other checks (a GPU, a
    device map) are about the machine that loads it, which need not be this one."""
    # lazy: heavy to import (transformers)
    from transformers.quantizers.auto import AutoHfQuantizer

    try:
        AutoHfQuantizer.from_config(dict(qcfg), pre_quantized=True).validate_environment()
    except ImportError as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    except Exception:  # not a missing library: the loader's own error, on the loading machine
        return None
    return None


FROM_PUBLISHER = "use the config.json published with these weights"


def check_config_groups(qcfg: dict[str, Any]) -> None:
    """compressed-tensors' config_groups: a mapping of groups, each a mapping (every reader
    asks `.values()` and `.get` of them: a list or a scheme's name would fail as an
    AttributeError)."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return
    groups = qcfg.get("config_groups") or {}
    bad = [type(groups).__name__] if not isinstance(groups, dict) else [
        f"{name!r} is a {type(g).__name__}" for name, g in groups.items() if not isinstance(g, dict)
    ]  # fmt: skip
    if bad:
        raise QuantError(f"compressed-tensors config_groups of the wrong shape ({bad[0]}, not a "
                         "mapping of groups)", FROM_PUBLISHER)  # fmt: skip


def group_size(value: Any, fmt: str, channel: tuple[Any, ...] = ()) -> int:
    """A config's group_size: a positive int, 0 for a value in `channel` (the format's "one
    group a row"). A str, bool, float, 0 or negative size is refused: read as it was, it
    planned negative bytes, divided by zero or failed as a TypeError."""
    if any(value is c or (type(value) is int and value == c) for c in channel):
        return 0
    if type(value) is int and value > 0:
        return value
    raise QuantError(f"{fmt} group_size {value!r} is not a positive integer", FROM_PUBLISHER)


def describe(qcfg: dict[str, Any]) -> str:
    parts = [qcfg.get("quant_method"), qcfg.get("quant_algo"), qcfg.get("format")]
    return " / ".join(str(p) for p in parts if p) or "an unnamed quant_method"


def divides(size: int, parts: int, what: str) -> int:
    """size / parts, refused where it is not whole."""
    if parts <= 0 or size % parts:
        raise QuantError(f"{what}: a block of {size}/{parts} does not divide the weight",
                         "use the config.json published with these weights")  # fmt: skip
    return size // parts
