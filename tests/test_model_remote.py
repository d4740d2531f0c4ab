"""Checkpoints whose modeling code ships with them (config.json's auto_map).

The checkpoint here is written by the test: a tiny DeepSeek-like MoE (a dense first layer,
then MoE layers of 4 routed experts as fused 3-D stacks, top-2, one shared expert, a
sigmoid router) in its own configuration/modeling files, for a model_type transformers does
not ship. With --trust-remote-code moetune counts it exactly, recipes it, plans it and trains
it; without, one line names the files and the flag.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.model import load_spec
from moetune.model.remote import RemoteCodeError, register_remote_classes

pytestmark = pytest.mark.filterwarnings("ignore")
MODEL_TYPE = "tiny_remote_moe"

CONFIGURATION = """
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote_moe"

    def __init__(self, vocab_size=128, hidden_size=32, intermediate_size=48,
                 moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                 n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.rms_norm_eps = rms_norm_eps
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
"""

MODELING = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


class TinyRemoteAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        size = config.hidden_size
        self.q_proj = nn.Linear(size, size, bias=False)
        self.k_proj = nn.Linear(size, size, bias=False)
        self.v_proj = nn.Linear(size, size, bias=False)
        self.o_proj = nn.Linear(size, size, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h))


class TinyRemoteMLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyRemoteExperts(nn.Module):
    """Routed experts as two stacks: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, config):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.02)

    def forward(self, x, index, weight):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = (x[token] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[e].T
            out.index_add_(0, token, y * weight[token, slot, None])
        return out


def expert_list(config):
    """Routed experts as DeepSeek-MoE 16B ships them: a plain ModuleList of MLPs."""
    h, i = config.hidden_size, config.moe_intermediate_size
    return nn.ModuleList(TinyRemoteMLP(h, i) for _ in range(config.n_routed_experts))


def run_expert_list(experts, x, index, weight):
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = torch.where(index == e)
        if token.numel():
            out.index_add_(0, token, expert(x[token]) * weight[token, slot, None])
    return out


class TinyRemoteGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * 0.02)

    def forward(self, x):
        scores = torch.sigmoid(x @ self.weight.T)
        weight, index = scores.topk(self.top_k, dim=-1)
        return index, weight / weight.sum(-1, keepdim=True)


class TinyRemoteMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = TinyRemoteGate(config)
        self.as_list = getattr(config, "experts_as_list", False)
        self.experts = expert_list(config) if self.as_list else TinyRemoteExperts(config)
        inner = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = TinyRemoteMLP(config.hidden_size, inner)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        index, weight = self.gate(flat)
        run = run_expert_list if self.as_list else lambda e, *a: e(*a)
        routed = run(self.experts, flat, index, weight).view_as(x)
        return routed + self.shared_experts(x)


class TinyRemoteDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = TinyRemoteRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TinyRemoteAttention(config)
        self.post_attention_layernorm = TinyRemoteRMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = layer_idx < config.first_k_dense_replace
        self.mlp = (TinyRemoteMLP(config.hidden_size, config.intermediate_size) if dense
                    else TinyRemoteMoE(config))

    def forward(self, x, **kwargs):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyRemotePreTrainedModel(PreTrainedModel):
    config_class = TinyRemoteConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TinyRemoteDecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class TinyRemoteModel(TinyRemotePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TinyRemoteDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TinyRemoteRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x))


class TinyRemoteForCausalLM(TinyRemotePreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyRemoteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, labels=None, inputs_embeds=None, **kwargs):
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds).last_hidden_state
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
'''

AUTO_MAP = {
    "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
    "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
}

# config.json states every size, as a published one does
SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
         "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "first_k_dense_replace": 1}  # fmt: skip


def write_checkpoint(out: Path, weights: bool = False, **extra: object) -> Path:
    """A remote-code checkpoint dir: its two code files, config.json with auto_map (and
    `extra` fields), and (weights) random fp32 weights with the demo's character tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "configuration_tiny_remote.py").write_text(CONFIGURATION, encoding="utf-8")
    (out / "modeling_tiny_remote.py").write_text(MODELING, encoding="utf-8")
    config = {"model_type": MODEL_TYPE, "architectures": ["TinyRemoteForCausalLM"],
              "auto_map": AUTO_MAP, **SIZES, **extra}  # fmt: skip
    if weights:
        from moetune.demo.tokenizer import build_tokenizer

        tok = build_tokenizer()
        ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
               "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}  # fmt: skip
        config |= ids
        _save_weights(out, config)
        tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def _save_weights(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    config_cls, model_cls = register_remote_classes(str(out), config)
    fields = {k: v for k, v in config.items() if k not in ("auto_map", "model_type")}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_cls(config_cls(**fields)).save_pretrained(out)


def _expected_total(vocab: int = 128) -> int:
    """The tiny checkpoint's parameters, by hand: embeddings + head, 3 layers of attention
    and 2 norms, one dense MLP, two MoE blocks (router, 4 experts, a shared expert), a norm."""
    h, dense, moe, experts = 32, 48, 16, 4
    attention, norms = 4 * h * h, 2 * h
    mlp = 3 * h * dense
    block = experts * h + experts * 3 * moe * h + 3 * h * moe
    return 2 * vocab * h + 3 * (attention + norms) + mlp + 2 * block + h


def test_refused_without_the_flag_in_one_line(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    with pytest.raises(RemoteCodeError) as err:
        load_spec(str(ckpt))
    assert "configuration_tiny_remote.py, modeling_tiny_remote.py" in err.value.cause
    assert "--trust-remote-code" in err.value.fix and "rights" in err.value.fix
    result = CliRunner().invoke(app, ["inspect", str(ckpt)])
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr and "--trust-remote-code" in result.stderr


def test_inspect_counts_the_remote_build_exactly(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    result = CliRunner().invoke(app, ["inspect", str(ckpt), "--trust-remote-code", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model_type"] == MODEL_TYPE and data["total_params"] == _expected_total()
    assert (data["num_experts"], data["top_k"], data["moe_layers"]) == (4, 2, [1, 2])
    comp = data["components"]
    assert comp["routed_experts"] == 2 * 4 * 3 * 16 * 32 and comp["routers"] == 2 * 4 * 32
    assert comp["shared_experts"] == 2 * 3 * 32 * 16 and comp["dense_mlp"] == 3 * 32 * 48
    routed_inactive = comp["routed_experts"] // 2  # top-2 of 4
    assert data["active_params"] == data["total_params"] - routed_inactive


def test_recipe_and_analytic_plan_with_the_flag(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    runner = CliRunner()
    recipe = runner.invoke(app, ["recipe", str(ckpt), "--trust-remote-code", "--json"])
    assert recipe.exit_code == 0, recipe.output
    peft = json.loads(recipe.stdout)
    assert peft["coverage"]["coverage"] == 1.0 and not peft["coverage"]["router_adapted"]
    stacks = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert set(peft["peft_config"]["target_parameters"]) == stacks
    plan = runner.invoke(app, ["plan", str(ckpt), "--trust-remote-code", "--json"])
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.stdout)
    assert planned["estimator"] == "analytic" and planned["peak_bytes"] > 0
    assert "REMOTE-CODE" in planned["findings"]


def _train_three_steps(ckpt: Path, tmp_path: Path) -> Any:
    """Three steps with model.trust_remote_code: coverage 1, router unchanged."""
    from moetune.train.trainer import train
    from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(12))
    cfg = run_config(ckpt, data, tmp_path / "run", max_steps=3, save_steps=3, seq_len=16)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": True})})
    with one_thread():
        result = train(cfg, progress=False)
    assert (result.steps, result.coverage, result.router_changed) == (3, 1.0, False)
    return result


def test_three_training_steps_save_an_adapter(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", weights=True)
    result = _train_three_steps(ckpt, tmp_path)
    adapter = Path(result.adapter_dir)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert any("experts" in p for p in saved["target_parameters"])
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0


def test_experts_as_a_module_list_train_every_expert(tmp_path: Path) -> None:
    """DeepSeek-MoE 16B's own layout: routed experts as a ModuleList of MLPs (three Linears
    each), a router that is a bare weight. Counted the same, LoRA on all 3 Linears of every
    expert (24 in 2 layers), the router left alone, three steps at coverage 1."""
    ckpt = write_checkpoint(tmp_path / "ckpt", weights=True, experts_as_list=True)
    runner = CliRunner()
    inspect = runner.invoke(app, ["inspect", str(ckpt), "--trust-remote-code", "--json"])
    assert inspect.exit_code == 0, inspect.output
    spec = json.loads(inspect.stdout)
    assert spec["components"]["routed_experts"] == 2 * 4 * 3 * 16 * 32
    assert spec["total_params"] == _expected_total(vocab=spec["vocab_size"])
    recipe = runner.invoke(app, ["recipe", str(ckpt), "--trust-remote-code", "--json"])
    assert recipe.exit_code == 0, recipe.output
    peft = json.loads(recipe.stdout)
    assert peft["coverage"]["coverage"] == 1.0 and not peft["coverage"]["router_adapted"]
    assert peft["coverage"]["by_kind"]["experts"] == {"adapted": 24, "expected": 24}
    result = _train_three_steps(ckpt, tmp_path)
    from safetensors.torch import load_file

    saved = load_file(Path(result.adapter_dir) / "adapter_model.safetensors")
    experts = {k.split(".experts.")[1].split(".")[0] for k in saved if ".experts." in k}
    assert experts == {"0", "1", "2", "3"}
    _merged_export_is_the_adapter(ckpt, Path(result.adapter_dir).parent, tmp_path)


def _merged_export_is_the_adapter(ckpt: Path, run: Path, tmp_path: Path) -> None:
    """The run exports merged with its own trust (its config says so): the code files go
    along, the fp32 base stays fp32, and the merged model computes what base + adapter do.
    The bare adapter dir, whose config says nothing of trust, is refused in one line."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runner = CliRunner()
    copy = write_checkpoint(tmp_path / "copy", experts_as_list=True)  # not trusted in-process
    refused = runner.invoke(app, ["export", str(run / "adapter"), "--format", "merged",
                                  "--out", str(tmp_path / "no"), "--base", str(copy)])  # fmt: skip
    assert refused.exit_code == 2 and "--trust-remote-code" in refused.stderr, refused.output
    assert not (tmp_path / "no").exists()
    out = tmp_path / "merged"
    done = runner.invoke(app, ["export", str(run), "--format", "merged", "--out", str(out),
                               "--no-check", "--json"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["details"]["dtype"] == "float32"
    assert {"configuration_tiny_remote.py", "modeling_tiny_remote.py"} <= {
        p.name for p in out.iterdir()
    }
    ids = torch.tensor([[5, 9, 3, 17, 11, 4]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).double()
        base = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True)
        peft = PeftModel.from_pretrained(base, str(run / "adapter")).double()
        want, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
        moved = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).double()
        moved_by = (moved(input_ids=ids).logits - want).norm()
    assert (got - want).norm() < 1e-6 * want.norm() and moved_by > 1e-4 * want.norm()


def test_kimi_k2_builds_as_deepseek_v3_without_running_its_code() -> None:
    """The catalog's Kimi-K2 ships DeepSeek-V3's modeling file under model_type kimi_k2:
    it builds as transformers' deepseek_v3, no flag needed, nothing of the checkpoint run."""
    from moetune.model import catalog_meta

    spec = load_spec("Kimi-K2-Instruct")
    assert (spec.model_type, spec.num_layers, spec.num_experts, spec.top_k) == (
        "deepseek_v3",
        61,
        384,
        8,
    )
    assert spec.num_shared_experts == 1 and spec.moe_layers == tuple(range(1, 61))
    assert catalog_meta("moonshotai/Kimi-K2-Instruct")["published_model_type"] == "kimi_k2"
