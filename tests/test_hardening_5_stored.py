"""Issue 48 (fifth hardening pass), stored formats: compressed-tensors' `pack-quantized` at
8 bits is a real format (its PackedQuantizationCompressor packs num_bits 1–8 into int32
words), so moetune reads it – equal to compressed-tensors' own decompress – and a config
whose num_bits disagrees with the packed words is refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch

from moetune.engine.quant.stacks import QuantError
from moetune.engine.stored.formats import stored_format
from test_engine_stored_int import _bufs, _ct, _ct_cfg, _w


@pytest.mark.parametrize(("group", "symmetric"), [(16, True), (None, True), (32, False)])
def test_pack_quantized_8_bit_reads_as_compressed_tensors_decompresses(group, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    pack_to_int32(torch.zeros(1, 32, dtype=torch.int8), 8)  # 8 bits: a width it packs
    weights = {"num_bits": 8, "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group}  # fmt: skip
    fmt = stored_format(_ct_cfg(**weights))
    sd, ref = _ct(_w(24, 64).double(), 8, group, symmetric)  # its compressor, its decompress
    bufs = _bufs(sd)
    fmt.check(bufs, (24, 64), "proj")
    mine = fmt.dequantize(bufs, (24, 64), torch.float64)[0]
    assert float((mine - ref).norm() / ref.norm()) <= 1e-6
    assert float((mine - _w(24, 64).double()).norm() / _w(24, 64).double().norm()) < 0.01


@pytest.mark.parametrize(("said", "stored"), [(8, 4), (4, 8)])
def test_num_bits_that_disagree_with_the_packed_words_are_refused(said, stored):
    sd, _ = _ct(_w(24, 64), stored, 16, True)
    fmt = stored_format(_ct_cfg(num_bits=said))  # was: read at the words' width, unsaid
    with pytest.raises(QuantError) as info:
        fmt.check(_bufs(sd), (24, 64), "model.layers.0.mlp.experts")
    cause = info.value.cause
    assert f"hold {stored}-bit codes, but quantization_config says num_bits {said}" in cause
    assert cause.startswith("model.layers.0.mlp.experts packed weight")
