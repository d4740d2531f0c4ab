"""Issue 48's fresh sweep, each stored format's metadata: a quantization_config of the wrong
shape or values (the compressed-tensors ones written by compressed-tensors' own models), and
tiny safetensors with the publishers' key names whose tensors are missing, mis-shaped or of
the wrong dtype. Each is one line naming the field or tensor, before a model is built; a
float tensor under a code key (a stale float file) is never multiplied by the scales.
Cases marked "was:" failed on the previous main."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from click.testing import CliRunner
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from safetensors.torch import save_file

from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR
from moetune.engine.quant.stacks import QuantError
from moetune.engine.stack_files import index_dir
from moetune.engine.stored.awq import AWQ
from moetune.engine.stored.ct_fp8 import BlockFP8CompressedTensors, ScaledFP8CompressedTensors
from moetune.engine.stored.ct_nvfp4 import NVFP4CompressedTensors
from moetune.engine.stored.formats import StoredFormat, stored_format
from moetune.engine.stored.fp8 import BlockFP8
from moetune.engine.stored.fp8_scaled import ScaledFP8
from moetune.engine.stored.gptq import GPTQ
from moetune.engine.stored.int4 import Int4Packed, Int4PackedZeroPoint
from moetune.engine.stored.load import stack_files
from moetune.engine.stored.mxfp4 import MXFP4
from moetune.engine.stored.nvfp4 import NVFP4
from moetune.errors import MoetuneError
from test_hardening_4_stored import _w

# typer builds the click command anew on every invoke (~0.2 s); the sweep builds it once
CLI = typer.main.get_command(app)


def ct(fmt: str = "pack-quantized", **weights: Any) -> dict[str, Any]:
    """A quantization_config as compressed-tensors writes it (its own pydantic models)."""
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
            "symmetric": True, **weights}  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    return QuantizationConfig(config_groups={"group_0": scheme}, format=fmt).model_dump(
        exclude_none=True
    )


def ct_weights(**edit: Any) -> dict[str, Any]:
    """A valid pack-quantized config, then its weights' fields edited past what the models
    allow (a hand-edited or corrupt config.json)."""
    doc = ct()
    doc["config_groups"]["group_0"]["weights"].update(edit)
    return doc


FLOAT8 = {"num_bits": 8, "type": "float", "group_size": None}
QCFG: list[tuple[str, Any, str]] = [
    ("gptq/group-0", {"quant_method": "gptq", "bits": 4, "group_size": 0},
     "GPTQ group_size 0 is not a positive integer"),  # was: read per channel
    ("gptq/group-negative", {"quant_method": "gptq", "bits": 4, "group_size": -2},
     "GPTQ group_size -2"),  # was: planned negative bytes
    ("gptq/group-str", {"quant_method": "gptq", "bits": 4, "group_size": "128"},
     "GPTQ group_size '128'"),  # was: exit 3 (TypeError) in plan
    ("gptq/group-float", {"quant_method": "gptq", "bits": 4, "group_size": 32.5},
     "GPTQ group_size 32.5"),  # was: accepted
    ("gptq/group-bool", {"quant_method": "gptq", "bits": 4, "group_size": True},
     "GPTQ group_size True"),  # was: groups of 1
    ("gptq/bits-3", {"quant_method": "gptq", "bits": 3}, "GPTQ with 3-bit codes is not read"),
    ("gptq/bits-str", {"quant_method": "gptq", "bits": "4"},
     "GPTQ with '4'-bit codes"),  # was: "with 4-bit codes is not read", fix "use 4-bit"
    ("gptq/format-marlin", {"quant_method": "gptq", "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin' is not read"),
    ("awq/group-0", {"quant_method": "awq", "bits": 4, "group_size": 0},
     "AWQ group_size 0"),  # was: exit 3 (ZeroDivisionError) in plan
    ("awq/group-negative", {"quant_method": "awq", "bits": 4, "group_size": -1},
     "AWQ group_size -1"),  # was: planned negative bytes
    ("awq/group-str", {"quant_method": "awq", "bits": 4, "group_size": "32"},
     "AWQ group_size '32'"),  # was: exit 3 (TypeError) in plan
    ("awq/bits-8", {"quant_method": "awq", "bits": 8}, "AWQ gemm with 8-bit codes"),
    ("awq/gemv", {"quant_method": "awq", "version": "gemv"}, "AWQ gemv with 4-bit codes"),
    ("awq/no-zero-point", {"quant_method": "awq", "zero_point": False}, "zero_point False"),
    ("ct/bits-3", ct_weights(num_bits=3), "pack-quantized with 3-bit codes"),
    ("ct/bits-missing", ct_weights(num_bits=None), "with None-bit codes"),
    ("ct/group-negative", ct_weights(group_size=-32),
     "compressed-tensors group_size -32"),  # was: planned negative bytes
    ("ct/group-str", ct_weights(group_size="32"),
     "compressed-tensors group_size '32'"),  # was: exit 3 (TypeError) in plan
    ("ct/group-0", ct_weights(group_size=0), "strategy group without group_size"),
    ("ct/strategy-tensor", ct(strategy="tensor", group_size=None), "with strategy tensor"),
    ("ct/strategy-block", ct(strategy="block", group_size=None, block_structure=[32, 32]),
     "with strategy block"),
    ("ct/type-float", ct_weights(type="float"), "pack-quantized with type float"),
    ("ct/dynamic", ct_weights(dynamic=True), "dynamic weight scales"),
    ("ct/actorder", ct_weights(actorder="static"), "actorder static"),
    ("ct/sparse-format", ct(fmt="sparse-24-bitmask"), "compressed-tensors / sparse-24-bitmask"),
    ("ct/int-quantized", ct(fmt="int-quantized", num_bits=8, strategy="channel", group_size=None),
     "compressed-tensors / int-quantized"),
    ("ct/float-quantized-4bit", ct(fmt="float-quantized", **{**FLOAT8, "num_bits": 4},
                                   strategy="channel"), "float-quantized with 4-bit floats"),
    ("ct/groups-empty", {**ct(), "config_groups": {}}, "compressed-tensors / pack-quantized"),
    ("ct/groups-list", {**ct(), "config_groups": [1, 2]},
     "config_groups of the wrong shape (list"),  # was: exit 3 (AttributeError)
    ("ct/group-a-name", {**ct(), "config_groups": {"group_0": "W4A16"}},
     "('group_0' is a str"),  # was: exit 3 (AttributeError)
    ("fp8/block-one-size", {"quant_method": "fp8", "weight_block_size": [128]},
     "is not two positive integer sizes"),
    ("fp8/block-zero", {"quant_method": "fp8", "weight_block_size": [0, 128]}, "[0, 128] is not"),
    ("fp8/block-three", {"quant_method": "fp8", "weight_block_size": [8, 8, 8]}, "is not two"),
    ("fp8/block-bools", {"quant_method": "fp8", "weight_block_size": [True, True]}, "is not two"),
    ("method/unknown", {"quant_method": "hqq"}, "cannot read checkpoints quantised as hqq"),
    ("method/missing", {"bits": 4}, "an unnamed quant_method"),
    ("method/a-number", {"quant_method": 4}, "quantised as 4"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "qcfg", "says"), QCFG, ids=[c[0] for c in QCFG])
def test_a_quantization_config_of_the_wrong_shape_is_refused(name: str, qcfg: Any, says: str):
    """stored_format is what inspect, plan, the rules and the loader all ask."""
    with pytest.raises(QuantError) as info:
        stored_format(qcfg)
    assert says in info.value.cause and info.value.fix, info.value.cause


@pytest.mark.parametrize(
    ("qcfg", "command", "says"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 0}, "plan", "AWQ group_size 0"),
        ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, "plan", "group_size '128'"),
        ({**ct(), "config_groups": [1, 2]}, "inspect", "config_groups of the wrong shape"),
    ],
)
def test_what_was_exit_3_is_one_line_on_the_command_line(tmp_path: Path, qcfg, command, says):
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((SHIPPED_DIR / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    shutil.copy(SHIPPED_DIR / "tokenizer.json", base)
    result = CliRunner().invoke(CLI, [command, str(base)])
    assert result.exit_code == 2, result.output  # was: exit 3, "unexpected TypeError" …
    line = result.stderr.strip().splitlines()[-1]
    assert says in line and " fix: " in line


# ---------------------------------------------------------------- the tensors in the files

E, OUT, IN = 2, 64, 128
PREFIX = "model.layers.0.mlp.experts"
FORMATS: dict[str, type[StoredFormat]] = {
    "fp8-block": BlockFP8.configured(block=(32, 32)),
    "fp8-channel": ScaledFP8,
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,
    "gptq": GPTQ,
    "awq": AWQ,
    "ct-int4": Int4Packed,
    "ct-int4-zp": Int4PackedZeroPoint,
    "ct-fp8-channel": ScaledFP8CompressedTensors,
    "ct-fp8-block": BlockFP8CompressedTensors.configured(block=(32, 32)),
    "ct-nvfp4": NVFP4CompressedTensors,
}
Edit = Callable[[dict[str, torch.Tensor], Callable[[str, int], str]], None]


def _drop(buf: str, experts: range = range(E)) -> Edit:
    def edit(t: dict[str, torch.Tensor], key: Callable[[str, int], str]) -> None:
        for e in experts:
            del t[key(buf, e)]

    return edit


def _as(buf: str, dtype: torch.dtype) -> Edit:
    def edit(t: dict[str, torch.Tensor], key: Callable[[str, int], str]) -> None:
        for e in range(E):
            t[key(buf, e)] = t[key(buf, e)].to(dtype)

    return edit


def _transposed(buf: str) -> Edit:
    def edit(t: dict[str, torch.Tensor], key: Callable[[str, int], str]) -> None:
        for e in range(E):
            t[key(buf, e)] = t[key(buf, e)].T.contiguous()

    return edit


def _one_expert_short(buf: str) -> Edit:
    def edit(t: dict[str, torch.Tensor], key: Callable[[str, int], str]) -> None:
        t[key(buf, 1)] = t[key(buf, 1)][:-1].contiguous()

    return edit


STALE = "where the format stores codes (integers or fp8), so its values would be misread"
FILES: list[tuple[str, str, Edit, str]] = [
    # a float file's tensor under a code key: was read as codes and multiplied by the scales
    ("fp8-block", "weight-float32", _as("weight", torch.float32), STALE),  # was: trained on
    ("fp8-block", "weight-bf16", _as("weight", torch.bfloat16), STALE),  # was: trained on
    ("fp8-channel", "weight-float16", _as("weight", torch.float16), STALE),  # was: trained on
    ("ct-fp8-channel", "weight-float32", _as("weight", torch.float32), STALE),  # was: trained on
    ("mxfp4", "blocks-float32", _as("blocks", torch.float32), STALE),  # was: accepted
    ("nvfp4", "weight-float32", _as("weight", torch.float32), STALE),  # was: accepted
    ("ct-nvfp4", "weight-float32", _as("weight", torch.float32), STALE),  # was: accepted
    ("gptq", "qweight-float32", _as("qweight", torch.float32), STALE),  # was: accepted
    ("gptq", "qzeros-float16", _as("qzeros", torch.float16), STALE),  # was: accepted
    ("gptq", "g_idx-float32", _as("g_idx", torch.float32), STALE),  # was: accepted
    ("awq", "qweight-float32", _as("qweight", torch.float32), STALE),  # was: accepted
    ("awq", "qzeros-float32", _as("qzeros", torch.float32), STALE),  # was: accepted
    ("ct-int4", "packed-float32", _as("packed", torch.float32), STALE),  # was: accepted
    ("ct-int4-zp", "zero-float32", _as("zero", torch.float32), STALE),  # was: accepted
    ("ct-fp8-block", "weight-float32", _as("weight", torch.float32), "not float8_e4m3fn"),
    # scales or zeros missing, of an integer dtype, transposed; one expert missing or short
    ("fp8-block", "scales-missing", _drop("scale_inv"), "has no 'weight_scale_inv' tensors"),
    ("fp8-block", "scales-int", _as("scale_inv", torch.int32), "are int32, not the format's"),
    # every integer dtype safetensors stores is named (was: int16 / uint16 … "has no" tensors)
    ("fp8-block", "scales-int16", _as("scale_inv", torch.int16), "are int16, not the format's"),
    ("awq", "scales-int16", _as("scales", torch.int16), "'scales' are int16"),
    ("nvfp4", "global-scale-uint16", _as("scale_2", torch.uint16), "'scale_2' are uint16"),
    ("ct-int4", "scales-uint32", _as("scale", torch.uint32), "'scale' are uint32"),
    ("gptq", "scales-uint64", _as("scales", torch.uint64), "'scales' are uint64"),
    ("fp8-channel", "scales-bool", _as("scale", torch.bool), "'scale' are bool"),
    ("fp8-block", "scales-transposed", _transposed("scale_inv"), "scale grid [4, 2] is not"),
    ("fp8-channel", "scales-missing", _drop("scale"), "has no 'weight_scale' tensors"),
    ("mxfp4", "scales-missing", _drop("scales"), "has no 'weight_scales' tensors"),
    ("mxfp4", "scales-float", _as("scales", torch.float32), "are float32, not the format's"),
    ("mxfp4", "scales-transposed", _transposed("scales"), "tensor 'scales' is [4, 64]"),
    ("nvfp4", "scales-missing", _drop("scale"), "has no 'weight_scale' tensors"),
    ("nvfp4", "global-scale-missing", _drop("scale_2"), "has no 'weight_scale_2' tensors"),
    ("nvfp4", "global-scale-int", _as("scale_2", torch.int32), "'scale_2' are int32"),
    ("ct-nvfp4", "global-scale-missing", _drop("scale_2"), "'weight_global_scale' tensors"),
    ("gptq", "zeros-missing", _drop("qzeros"), "has no 'qzeros' tensors"),
    ("gptq", "g_idx-missing", _drop("g_idx"), "has no 'g_idx' tensors"),
    ("gptq", "zeros-transposed", _transposed("qzeros"), "tensor 'qzeros' is [8, 4]"),
    ("gptq", "scales-int", _as("scales", torch.int32), "'scales' are int32"),
    ("awq", "zeros-missing", _drop("qzeros"), "has no 'qzeros' tensors"),
    ("awq", "scales-missing", _drop("scales"), "has no 'scales' tensors"),
    ("awq", "scales-int", _as("scales", torch.int32), "'scales' are int32"),
    ("ct-int4", "scales-missing", _drop("scale"), "has no 'weight_scale' tensors"),
    ("ct-int4", "scales-transposed", _transposed("scale"), "tensor 'scale' is [4, 64]"),
    ("ct-int4", "scales-int", _as("scale", torch.int32), "'scale' are int32"),
    ("ct-int4-zp", "zeros-missing", _drop("zero"), "has no 'weight_zero_point' tensors"),
    ("ct-int4-zp", "zeros-transposed", _transposed("zero"), "tensor 'zero' is [4, 8]"),
    ("ct-fp8-block", "scales-int", _as("scale_inv", torch.int32), "'scale_inv' are int32"),
    ("fp8-block", "expert-1-missing", _drop("weight", range(1, 2)), "has no 'weight' tensors"),
    ("gptq", "expert-1-missing", _drop("scales", range(1, 2)), "has no 'scales' tensors"),
    ("fp8-block", "expert-1-short", _one_expert_short("weight"), "16256 elements for a 16384"),
    ("awq", "expert-1-short-zeros", _one_expert_short("qzeros"), "56 elements for a 64"),
]  # fmt: skip


@pytest.fixture(scope="module")
def published() -> dict[str, dict[str, torch.Tensor]]:
    """Each format's buffers of one [E, out, in] stack, written as its publisher lays them."""
    return {name: fmt.quantize(_w(E, OUT, IN)) for name, fmt in FORMATS.items()}


@pytest.mark.parametrize(
    ("fmt_name", "case", "edit", "says"), FILES, ids=[f"{c[0]}/{c[1]}" for c in FILES]
)
def test_stored_tensors_of_the_wrong_kind_are_refused_by_name(
    tmp_path: Path, published, fmt_name: str, case: str, edit: Edit, says: str
) -> None:
    fmt = FORMATS[fmt_name]

    def key(buf: str, e: int) -> str:
        return f"{PREFIX}.{e}.down_proj.{fmt.keys[buf][0]}"

    tensors = {key(b, e): v[e].contiguous() for b, v in published[fmt_name].items()
               for e in range(E)}  # fmt: skip
    edit(tensors, key)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MoetuneError) as info:  # the loader's own steps, short of a model
        files = stack_files(fmt, index_dir(tmp_path), PREFIX, "down_proj", (E, OUT, IN), False)
        fmt.check(files.read(), (OUT, IN), f"{PREFIX}.down_proj")
    assert says in info.value.cause and info.value.fix, info.value.cause
    assert "\n" not in str(info.value)


def test_the_published_layouts_themselves_are_read(tmp_path: Path, published) -> None:
    """The baseline of every case above: unedited, each format's files pass."""
    for name, fmt in FORMATS.items():
        folder = tmp_path / name
        folder.mkdir()
        tensors = {f"{PREFIX}.{e}.down_proj.{fmt.keys[b][0]}": v[e].contiguous()
                   for b, v in published[name].items() for e in range(E)}  # fmt: skip
        save_file(tensors, str(folder / "model.safetensors"))
        files = stack_files(fmt, index_dir(folder), PREFIX, "down_proj", (E, OUT, IN), False)
        fmt.check(files.read(), (OUT, IN), name)


def test_the_stored_sweep_has_its_cases() -> None:
    assert len(QCFG) + len(FILES) >= 75
    assert len({c[0] for c in QCFG}) == len(QCFG)
    assert len({(c[0], c[1]) for c in FILES}) == len(FILES)
