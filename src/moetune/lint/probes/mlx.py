"""Probes of the mlx-lm traps (lint/rules/mlx.py), on the installed mlx / mlx-lm; each raises
ProbeUnavailable where mlx cannot run here (probes.py has the conventions)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata
from typing import Any

from packaging.requirements import Requirement

from moetune.lint.mlx_env import backend_fix, mlx_backend, pin_problems
from moetune.lint.probes.tiny import _TINY, _TINY_MOE, _quiet, _version
from moetune.lint.registry import ProbeOutcome, ProbeUnavailable


def _need_mlx() -> None:
    found = mlx_backend()
    if found.mlx_lm is None:
        raise ProbeUnavailable("mlx-lm is not installed here (pip install 'moetune[mlx]')")
    if found.backend is None:
        raise ProbeUnavailable(f"mlx-lm has no mlx backend here ({found.error}): {backend_fix()}")


_MLX_TINY = (
    {"model_type": "qwen3_moe", **_TINY, **_TINY_MOE["qwen3_moe"], "rms_norm_eps": 1e-6}
    | {"decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1e4}
    | {"tie_word_embeddings": False, "max_position_embeddings": 64, "norm_topk_prob": True}
)


def _mlx_adapted(keys: list[str] | None) -> set[str]:
    """Module names in layer 0 of a tiny mlx-lm qwen3_moe that LoRA replaced."""
    # lazy: heavy to import (mlx_lm)
    from mlx_lm.models import qwen3_moe  # type: ignore[import-not-found]
    from mlx_lm.tuner.utils import linear_to_lora_layers  # type: ignore[import-not-found]

    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(_MLX_TINY))
    config: dict[str, Any] = {"rank": 2, "scale": 1.0, "dropout": 0.0}
    if keys is not None:
        config["keys"] = keys
    linear_to_lora_layers(model, len(model.layers), config)
    named = model.layers[0].named_modules()
    return {name for name, mod in named if type(mod).__name__.startswith("LoRA")}


def mlx_default_keys() -> ProbeOutcome:
    """Without keys, mlx-lm adapts the router (mlp.gate) too."""
    _need_mlx()
    try:
        got = _mlx_adapted(None)
    except Exception as err:  # e.g. mlx-lm < 0.28.2: "Lora does not support qwen3_moe"
        return ProbeOutcome(False, f"mlx-lm default keys failed: {err!r}")
    return ProbeOutcome("mlp.gate" in got, f"mlx-lm default keys adapted: {sorted(got)}")


def mlx_keys_no_match() -> ProbeOutcome:
    """HF per-expert names match nothing in mlx-lm and raise nothing."""
    _need_mlx()
    try:
        got = _mlx_adapted(["mlp.experts.0.up_proj"])
    except Exception as err:  # a loud failure means the trap (silence) is gone
        return ProbeOutcome(False, f"mlx-lm rejected an unknown key: {err!r}")
    return ProbeOutcome(not got, f"keys ['mlp.experts.0.up_proj'] adapted: {sorted(got)}")


# Import mlx_lm, write a tiny qwen3_moe in mlx-lm's layout (config, weights, a transformers
# tokenizer), load it back through mlx_lm.load and run one forward: what a user's run does.
_MLX_LOAD_SCRIPT = """
import json, sys, tempfile
import mlx.core as mx
import mlx_lm
from mlx_lm.models import qwen3_moe
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
cfg = json.loads(sys.argv[1])
out = tempfile.mkdtemp()
save_model(out, qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(cfg)))
save_config(dict(cfg), out + "/config.json")
vocab = {chr(97 + i): i for i in range(cfg["vocab_size"] - 1)} | {"<unk>": cfg["vocab_size"] - 1}
core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<unk>").save_pretrained(out)
model, tok = mlx_lm.load(out)
logits = model(mx.array([[1, 2, 3]]))
print(tuple(logits.shape))
"""


def _mlx_loads() -> tuple[bool, str]:
    """(whether a tiny model loaded and ran in a fresh interpreter, the evidence line)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MLX_LOAD_SCRIPT, json.dumps(_MLX_TINY)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode == 0:
        return True, f"logits {proc.stdout.strip()}"
    return False, (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]


def mlx_transformers_pin() -> ProbeOutcome:
    """The pin table must agree with reality: a known-bad pair fails to import or load
    (the trap), and a pair the table clears imports mlx_lm and loads a tiny model – a
    failure there is a bad pair the table does not know yet (review the rule)."""
    _need_mlx()
    versions = {lib: _version(lib) for lib in ("mlx-lm", "transformers")}
    predicted_bad = bool(pin_problems(versions))
    loads, evidence = _mlx_loads()
    verdict = "known-bad" if predicted_bad else "not a known-bad pair"
    line = f"{versions} ({verdict}): import mlx_lm + load a tiny model -> {evidence}"
    return ProbeOutcome(predicted_bad != loads, line)


_HIDE_MLX = """
import sys
sys.modules["mlx"] = None  # a Linux `pip install mlx-lm`: no mlx at all
try:
    import mlx_lm
except ImportError as exc:
    print(exc)
"""


def mlx_no_backend() -> ProbeOutcome:
    """mlx-lm requires mlx only on Darwin, so on Linux `pip install mlx-lm` brings no
    backend; without mlx, `import mlx_lm` fails (shown with mlx hidden from a fresh
    interpreter)."""
    _need_mlx()

    reqs = [Requirement(r) for r in metadata.requires("mlx-lm") or []]
    base = [r for r in reqs if r.name == "mlx" and "extra" not in str(r.marker or "")]
    darwin_only = bool(base) and all(
        r.marker is not None and not r.marker.evaluate({"platform_system": "Linux"}) for r in base
    )
    proc = subprocess.run(
        [sys.executable, "-c", _HIDE_MLX], capture_output=True, text=True, timeout=120
    )
    fails = proc.returncode == 0 and "mlx" in proc.stdout
    evidence = (
        f"mlx-lm {_version('mlx-lm')} requires {[str(r) for r in base]} (Darwin only: "
        f"{darwin_only}); import mlx_lm without mlx: {proc.stdout.strip() or proc.stderr[-200:]}"
    )
    return ProbeOutcome(darwin_only and fails, evidence)


def mlx_fused_keys() -> ProbeOutcome:
    """A model saved in mlx-lm's layout (what mlx_lm.fuse writes: stacked switch_mlp
    experts) loads in transformers without an error, its experts missing (random)."""
    _need_mlx()
    # lazy: heavy to import (mlx_lm, transformers)
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import save_config, save_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as out:
        save_model(out, qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(_MLX_TINY)))
        save_config(dict(_MLX_TINY), f"{out}/config.json")
        try:
            with _quiet():
                loaded: Any = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
                info: dict[str, list[str]] = loaded[1]
        except Exception as err:  # a loud failure: the silent trap is gone
            return ProbeOutcome(False, f"transformers refused the mlx layout: {err!r}"[:300])
    missing = sorted(k for k in info["missing_keys"] if ".experts." in k)
    unexpected = sorted(k for k in info["unexpected_keys"] if ".switch_mlp." in k)
    evidence = (
        f"loaded without error; {len(missing)} expert tensors missing (random), e.g. "
        f"{missing[:1]}; {len(unexpected)} switch_mlp tensors unused, e.g. {unexpected[:1]}"
    )
    return ProbeOutcome(bool(missing), evidence)


# -- GGUF -------------------------------------------------------------------------------
