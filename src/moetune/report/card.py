"""The README model card `moetune push` uploads: Hub metadata (base_model, library_name,
tags, license) and what the run's records say – the base and its published format, the LoRA
targets and their coverage audit, the router, the data, the plan's figures, the gate's
verdict with its rungs, served == trained, and how to load the result.

Everything comes from the run dir's own files, read as the report reads them
(`report/html.py`'s `load_inputs`); a record that is missing says so in the card, never
invents a figure. Local paths (a base or a data file on the training machine) appear by
file name only: a card is often public, the training machine's folders are not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from moetune.io import masked
from moetune.report.exports import export_row
from moetune.report.html import GATE_KEYS, Inputs, config_value, promotion
from moetune.report.inputs import lookup, read_json
from moetune.units import human_bytes

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what the pushed folder holds -> (library_name on the Hub, tags)
LIBRARIES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "adapter": ("peft", ("lora",)),
    "vllm": ("peft", ("lora", "vllm")),
    "merged": ("transformers", ("merged",)),
    "gguf": (None, ("gguf", "lora", "llama.cpp")),
    "mlx": ("mlx", ("mlx", "lora")),
}


def hub_base(inp: Inputs, given: str | None) -> str | None:
    """The base's Hub id: `given`, else model.id when it is one (a local dir has none)."""
    model_id = str(lookup(inp.config, "model.id") or "")
    if given:
        return given
    return model_id if HUB_ID.match(model_id) and not Path(model_id).exists() else None


def metadata(inp: Inputs, what: str, base: str | None, license_id: str | None) -> dict[str, Any]:
    """The card's YAML header, in huggingface_hub's ModelCardData keys."""
    library, tags = LIBRARIES[what]
    method = str(lookup(inp.config, "train.method") or "sft")
    data: dict[str, Any] = {"library_name": library, "license": license_id,
                            "tags": ["moetune", *tags, method, "moe"]}  # fmt: skip
    if base:
        data["base_model"] = base
        data["tags"].append(f"base_model:adapter:{base}")
        data["pipeline_tag"] = "text-generation"
    return {k: v for k, v in data.items() if v is not None}


def base_license(inp: Inputs) -> str | None:
    """The license the base's own card declares, when the base is a local dir with one."""
    readme = Path(str(lookup(inp.config, "model.id") or "")) / "README.md"
    if not readme.is_file():
        return None
    head = readme.read_text(encoding="utf-8", errors="replace").split("---")
    try:
        meta = yaml.safe_load(head[1]) if len(head) > 2 else None
    except yaml.YAMLError:
        return None
    return str(meta["license"]) if isinstance(meta, dict) and meta.get("license") else None


def published_format(inp: Inputs) -> str:
    """How the base is published (its config.json's quantization_config), when readable."""
    model_id = Path(str(lookup(inp.config, "model.id") or ""))
    config, _ = read_json(model_id / "config.json")
    if config is None:
        return "not recorded (the base is not a local dir)"
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return f"float ({config.get('torch_dtype') or config.get('dtype') or 'dtype not set'})"
    parts = [q.get("quant_method"), q.get("quant_algo"), q.get("format"), q.get("fmt")]
    return "quantised: " + (" / ".join(str(p) for p in parts if p) or "unnamed method")


def shown_path(value: Any) -> str:
    """A Hub id as is; a local path by its file name (the machine's folders stay private)."""
    text = str(value)
    if HUB_ID.match(text) and not Path(text).exists():
        return text
    return Path(text).name or text


def base_section(base: str | None) -> Callable[[Inputs], list[str]]:
    return lambda inp: _base_lines(inp, base)


def _base_lines(inp: Inputs, base: str | None) -> list[str]:
    cfg, published = inp.config, published_format(inp)
    name = base or f"{shown_path(lookup(cfg, 'model.id'))} (a local base; no Hub id given)"
    read = (
        f", read `{config_value(cfg, 'model.quantized_base')}`" if "quantised" in published else ""
    )
    return [
        "## Base model", "",
        f"- base: `{name}`",
        f"- published format: {published}",
        f"- held in training as `{config_value(cfg, 'model.dtype')}`, routed experts "
        f"`{config_value(cfg, 'model.experts_dtype')}`{read}",
        f"- method: `{config_value(cfg, 'train.method')}`, "
        f"tuning `{config_value(cfg, 'train.tuning')}`", "",
    ]  # fmt: skip


def lora_section(inp: Inputs) -> list[str]:
    cfg, cov = inp.config, inp.get("coverage.json")
    lines = [
        "## LoRA", "",
        f"- rank {config_value(cfg, 'lora.rank')} (experts: "
        f"{config_value(cfg, 'lora.expert_rank')}), alpha {config_value(cfg, 'lora.alpha')}, "
        f"engine `{config_value(cfg, 'lora.engine')}`",
        f"- targets: {config_value(cfg, 'lora.targets')}",
    ]  # fmt: skip
    if not cov:
        return [*lines, f"- coverage audit: not available ({inp.why['coverage.json']})", ""]
    by_kind = (cov.get("by_kind") or {}).items()
    kinds = ", ".join(f"{k} {v['adapted']}/{v['expected']}" for k, v in by_kind if v["expected"])
    lines += [
        f"- coverage audit: {cov.get('adapted')}/{cov.get('expected')} targets "
        f"({cov.get('coverage', 0):.0%}): {kinds}; missed: {len(cov.get('missed') or [])}",
        f"- trainable parameters: {cov.get('trainable_params'):,} of "
        f"{cov.get('total_params'):,}",
        f"- router: {router_line(inp)}", "",
    ]  # fmt: skip
    return lines


def router_line(inp: Inputs) -> str:
    """Frozen and unchanged, as the run measured it (sha256 of the router before / after)."""
    cov, router = inp.get("coverage.json"), inp.get("summary.json").get("router") or {}
    frozen = "adapted (trained)" if cov.get("router_adapted") else "frozen (no LoRA on it)"
    if not router:
        return f"{frozen}; its change was not measured (no summary.json)"
    same = router.get("sha256_before") == router.get("sha256_after")
    changed = "unchanged by training (same sha256 before and after)" if same else (
        f"changed in layers {router.get('changed_layers')}")  # fmt: skip
    return f"{frozen}; {changed}"


def data_section(inp: Inputs) -> list[str]:
    data = inp.get("data.json")
    if not data:
        return ["## Data", "", f"Not recorded ({inp.why['data.json']}).", ""]
    rows = [f"- `{shown_path(s.get('source'))}`: {s.get('rows')} rows × weight {s.get('weight')}"
            for s in data.get("sources") or []]  # fmt: skip
    return [
        "## Data", "",
        f"{data.get('rows')} {data.get('format')} rows, loss on {data.get('loss_on')}; "
        f"{data.get('overlong_rows_truncated', 0)} over seq_len cut; "
        f"sha256 `{str(data.get('sha256', ''))[:16]}`.", "", *rows, "",
    ]  # fmt: skip


def plan_section(inp: Inputs) -> list[str]:
    plan = inp.get("preflight.json").get("plan") or {}
    result = inp.get("summary.json").get("result") or {}
    lines = ["## Memory and run", ""]
    if plan:
        fits = [card for card, ok in (plan.get("fits") or {}).items() if ok]
        lines += [
            f"- planned peak ({plan.get('estimator')}): {human_bytes(plan.get('peak_bytes', 0))}"
            f" of tensors, {human_bytes(plan.get('required_bytes', 0))} with overhead",
            f"- fits: {', '.join(fits) or 'no listed card'}",
        ]
    else:
        lines.append(f"- plan: not available ({inp.why['preflight.json']})")
    if result:
        lines.append(
            f"- trained {result.get('steps')} steps on {result.get('device')}, final loss "
            f"{result.get('final_loss', 0):.4g}, measured peak "
            f"{human_bytes(result.get('peak_memory_bytes') or 0)}"
        )
    return [*lines, ""]


def gate_section(inp: Inputs) -> list[str]:
    verdict = inp.files.get("verdict.json")
    lines = ["## Evaluation and promotion", "", f"Promotion: {promotion(inp)}.", ""]
    if not verdict:
        return [*lines, "Gate: not run (no verdict.json in the run's results).", ""]
    lines += [
        f"Gate verdict: **{verdict.get('verdict')}** (α {verdict.get('alpha')}): "
        f"{verdict.get('reason', '')} (verdict hash `{str(verdict.get('hash', ''))[:12]}`)", "",
        "| rung | role | status | Δ | 95% bounds | threshold | n |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for rung in verdict.get("rungs") or []:
        r = {k: rung.get(k) for k in GATE_KEYS}
        lines.append(
            f"| {r['name']} | {r['role']} | {r['status']} | {_num(r['delta'])} | "
            f"[{_num(r['lower'])}, {_num(r['upper'])}] | {_num(r['threshold'])} | {r['n']} |"
        )
    return [*lines, ""]


def _guarded(section: Callable[[Inputs], list[str]], inp: Inputs) -> list[str]:
    """A section's lines, or one saying its record has a shape this card cannot read (the
    report's rule: a broken input never stops the rest)."""
    try:
        return section(inp)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        return [f"(a section is not available: its record has an unexpected format: "
                f"{type(exc).__name__}: {exc})", ""]  # fmt: skip


def _num(value: Any) -> str:
    return f"{value:+.4g}" if isinstance(value, int | float) else "–"


def exports_section(inp: Inputs) -> list[str]:
    doc, _ = read_json(inp.run_dir / "exports.json")
    if not doc:
        return ["## Served == trained", "", "No export was checked for this run.", ""]
    lines = ["## Served == trained", "", "| format | consumer | result | detail |",
             "|---|---|---|---|"]  # fmt: skip
    for fmt, entry in sorted(doc.items()):
        row = export_row(fmt, entry)
        lines.append(f"| {fmt} | {row['consumer']} | {row['status']} | {row['detail']} |")
    return [*lines, ""]


def usage_section(repo: str, base: str | None, what: str) -> list[str]:
    base = base or "BASE_MODEL_ID"
    peft = [
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{base}", dtype="auto")',
        f'model = PeftModel.from_pretrained(base, "{repo}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
        "```",
    ]
    uses = {
        "adapter": peft,
        "vllm": [
            f"`vllm serve {base} --enable-lora --lora-modules adapter={repo}` "
            "(the exact line and `LoRARequest`: vllm.json in this repo)."
        ],
        "merged": [f'`AutoModelForCausalLM.from_pretrained("{repo}")`, or `vllm serve {repo}`.'],
        "gguf": [
            "`llama-server -m BASE.gguf --lora adapter.gguf` (llama.cpp; the base "
            "converted with its `convert_hf_to_gguf.py`)."
        ],
        "mlx": [f"`mlx_lm.generate --model {base} --adapter-path {repo}`"],
    }
    lines = ["## How to load", "", *uses[what], ""]
    if what == "adapter":
        lines += [
            "For vLLM and llama.cpp, export it first: `moetune export RUN --format vllm` "
            "(or `gguf`), each checked served == trained.", "",
        ]  # fmt: skip
    return lines


def model_card(inp: Inputs, repo: str, what: str, base: str | None,
               license_id: str | None) -> str:  # fmt: skip
    """The README.md text (YAML header + body); secrets masked throughout."""
    meta = metadata(inp, what, base, license_id or base_license(inp))
    title = [f"# {repo.rpartition('/')[2]}", "",
             f"A {'LoRA adapter' if what == 'adapter' else what + ' export'} of a "
             "Mixture-of-Experts model, trained and checked with moetune.", ""]  # fmt: skip
    sections = [base_section(base), lora_section, data_section, plan_section,
                gate_section, exports_section]  # fmt: skip
    body = [*title, *(line for s in sections for line in _guarded(s, inp)),
            *usage_section(repo, base, what)]  # fmt: skip
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return masked(private_paths(f"---\n{header}---\n\n" + "\n".join(body), inp.run_dir))


def private_paths(text: str, run_dir: Path) -> str:
    """The training machine's folders out of a text (a promotion note names the adapter's
    path): the run dir as RUN_DIR, the user's home as ~."""
    for path, name in ((run_dir.resolve(), "RUN_DIR"), (run_dir, "RUN_DIR"), (Path.home(), "~")):
        if str(path) not in ("", ".", "/"):
            text = text.replace(str(path), name)
    return text
