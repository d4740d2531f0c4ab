"""Opt-in (`-m interop`, `make test-interop`): `--format gguf` through a real llama.cpp,
served == trained.

llama.cpp in its own venv (MOETUNE_LLAMACPP_PYTHON, default .venv-llamacpp/bin/
python: prebuilt xllamacpp + llama-cpp-py-sync, or llama-cpp-python built from source) and a
llama.cpp checkout for its converter (MOETUNE_LLAMA_CPP, the sdist's vendor/llama.cpp). For
the demo base and each family: the GGUF LoRA on base.gguf and the merged GGUF give the peft
adapter's logits and greedy outputs, and a GGUF LoRA without its expert tensors (what an
attention-only conversion serves) fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest

from export_fixtures import make_run
from moetune.demo.base import SHIPPED_DIR
from moetune.export import ExportOptions, resolve_source, run_export
from moetune.export.check import CheckOptions, check_export, compare, reference, tokenizer_of
from moetune.export.gguf import convert
from moetune.export.llamacpp import run_llamacpp

# `make setup-llamacpp`'s venv by default (set per test, not at import: collection of the
# default suite must not see it)
LLAMA_PY = os.environ.get(
    "MOETUNE_LLAMACPP_PYTHON", str(Path(__file__).parents[1] / ".venv-llamacpp/bin/python")
)
LLAMA_CPP = os.environ.get("MOETUNE_LLAMA_CPP", "")

pytestmark = [
    pytest.mark.interop,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(
        not Path(LLAMA_PY).is_file() or not (Path(LLAMA_CPP) / "convert_hf_to_gguf.py").is_file(),
        reason="needs llama-cpp-python's venv (MOETUNE_LLAMACPP_PYTHON) and MOETUNE_LLAMA_CPP",
    ),
]
# llama.cpp's qwen3moe has no o_proj bias and always renormalises the top-k weights (as
# the released Qwen3 MoE checkpoints do), its olmoe has no GQA (k_norm over n_embd): the
# tiny variants are made to match.
FAMILIES = {
    "demo": {},  # the shipped demo base (qwen3_moe, character tokenizer), not a tiny one
    "qwen3_moe-tied-local_experts": {"attention_bias": False, "norm_topk_prob": True},
    "gpt_oss": {},
    "olmoe": {"num_key_value_heads": 4},
    "mixtral": {},  # LLAMA arch, GQA (4 heads, 2 kv): q/k LoRA rows permuted
    "granitemoe-bias": {},  # GRANITE_MOE, a LlamaModel to the converter: permuted too
    "deepseek_v3": {},  # DEEPSEEK2: MLA (q_lora_rank 6), sigmoid router, shared expert
}
# The adapter per variant where it differs (default: q/o + mlp.experts.*): k_proj checks
# that the permutation uses the kv heads; granitemoe's experts sit in block_sparse_moe.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS: dict[str, dict[str, object]] = {
    "demo": {"scale": 0.1},
    # MLA's q / kv projections take no LoRA in llama.cpp (refused at export): o_proj and
    # the routed experts do (peft 0.21 drops gate/up/down_proj module targets here)
    "deepseek_v3": {"modules": ["o_proj"]},
    "mixtral": {"modules": ATTENTION},
    "granitemoe-bias": {
        "modules": ATTENTION,
        "experts": ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"],
    },
}


def _convert(model: Path, outfile: Path) -> None:
    """The export's own conversion (the tiny models carry the demo's character tokenizer,
    whose vocabulary moetune writes: the stock converter refuses its pre-tokenizer)."""
    convert(Path(LLAMA_CPP) / "convert_hf_to_gguf.py", model, outfile)


def _drop_experts(src: Path, dst: Path) -> None:
    """The GGUF LoRA minus its *_exps tensors: an attention-only conversion."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(reader.fields["adapter.lora.alpha"].contents()))
    for t in reader.tensors:
        if "_exps" not in t.name:
            writer.add_tensor(t.name, t.data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("variant", FAMILIES)
def test_llamacpp_serves_what_was_trained(
    tmp_path: Path, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOETUNE_LLAMA_CPP")  # converted below, the way the export does
    monkeypatch.setenv("MOETUNE_LLAMACPP_PYTHON", LLAMA_PY)
    base = SHIPPED_DIR if variant == "demo" else None
    run = make_run(tmp_path, variant, FAMILIES[variant], base, **ADAPTERS.get(variant, {}))
    source = resolve_source(run)
    out = tmp_path / "gguf"
    merged = out / "merged-hf"  # where the export puts it: the floor reads it
    run_export(source, "gguf", out, ExportOptions())
    run_export(source, "merged", merged, ExportOptions(dtype="float32"))
    _convert(Path(source.base), out / "base.gguf")
    _convert(merged, out / "merged.gguf")

    lora = check_export(source, "gguf", out, "float32", CheckOptions())
    assert lora.passed, lora.reason
    assert lora.own_error is not None  # llama.cpp's own merged-vs-merged error sets the floor

    tok = tokenizer_of(source)
    prompts = [list(tok(p)["input_ids"]) for p in ("copy:abc>", "rev:hello>", "sum:123>")]
    ref = reference(source, prompts, 8)
    served = run_llamacpp(out / "merged.gguf", None, ref.sequences, prompts, 8)
    # the same floor as the check: llama.cpp's own error on these merged weights
    full = compare("gguf", "llama.cpp merged.gguf", ref, served, "float32", 0.9, lora.own_error)
    assert full.passed, full.reason

    _drop_experts(out / "adapter.gguf", out / "attention-only.gguf")
    dropped = run_llamacpp(
        out / "base.gguf", out / "attention-only.gguf", ref.sequences, prompts, 8
    )
    # that floor still tells an adapter whose experts were dropped
    partial = compare("gguf", "attention-only", ref, dropped, "float32", 0.9, lora.own_error)
    assert not partial.passed
    print(f"\n{variant}: lora {lora.logits_rel:.2g} (greedy {lora.greedy_match:.0%}), merged "
          f"{full.logits_rel:.2g} (greedy {full.greedy_match:.0%}), attention-only "
          f"{partial.logits_rel:.2g}, expert effect {lora.expert_effect:.2g}, merged vs merged "
          f"{lora.own_error:.2g}")  # fmt: skip
