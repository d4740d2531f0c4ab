"""How often a GRPO training pass routes a token to other experts than its rollout did, and
what routing replay costs: the demo MoE (qwen3_moe) and a tiny deepseek_v3 (sigmoid scores,
a shared expert), rollout in fp32 and in bf16, the training pass in fp32.

    PYTHONPATH=src python benchmarks/grpo_routing.py [--rounds 3] [--smoke] [--record]

Each round samples as TRL's GRPO does (8 prompts × 4 generations, left-padded, temperature
1, a KV cache; the model cast to the rollout dtype), then runs the fp32 training forward +
backward over prompt + completion twice on the same rows: routing_replay off, then replay.
moetune's ShiftRecorder counts, per MoE layer, the share of tokens whose top-k expert set
(and whose first choice) differs from the rollout's; with replay it counts the tokens it
routed to the rollout's experts. The LoRA starts at zero (the first step): every figure is
the numerics of the two passes alone, no policy movement. Times are side by side in one
process after one untimed warm-up round; `--record` appends the table to
results/grpo-and-methods.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import bench_env
import torch

from moetune.demo.base import SHIPPED_DIR
from moetune.demo.skills import stream
from moetune.model import load_spec
from moetune.train.grpo.shift import LayerShift, ShiftRecorder

RESULTS = bench_env.results_page("grpo-and-methods")
HEAD = "## GRPO routing shift and routing replay (`benchmarks/grpo_routing.py`)"


def tiny_deepseek(root: Path) -> Path:
    """A random tiny deepseek_v3 (shared expert, sigmoid router) with the demo tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moetune.demo.tokenizer import build_tokenizer
    from moetune.model.tiny import tiny_config

    tok = build_tokenizer()
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
           "bos_token_id": tok.bos_token_id}  # fmt: skip
    config = AutoConfig.for_model(**{**tiny_config("deepseek_v3"), "vocab_size": len(tok), **ids})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "deepseek_v3")
    tok.save_pretrained(root / "deepseek_v3")
    return root / "deepseek_v3"


def policy(path: Path) -> Any:
    """The base + a zero-initialised LoRA on the attention output (peft; MLA has no
    q_proj), fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, target_modules=["o_proj"]))


def prompts(tok: Any, n: int, group: int) -> dict[str, torch.Tensor]:
    texts = [it.prompt for it in islice(stream(["last", "copy"], 0, "train"), n)]
    tok.padding_side = "left"
    return dict(tok([t for t in texts for _ in range(group)], return_tensors="pt", padding=True))


def rollout(model: Any, batch: dict[str, torch.Tensor], dtype: torch.dtype, new: int) -> Any:
    """Sampled completions, the model cast to `dtype` for the rollout; the fp32 weights are
    restored after (a bf16 rollout engine beside fp32 master weights)."""
    master = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(dtype).eval()
    with torch.no_grad():
        seqs = model.generate(**batch, max_new_tokens=new, do_sample=True, temperature=1.0)
    model.to(torch.float32).load_state_dict(master)
    return seqs


def train_pass(model: Any, seqs: torch.Tensor, prompt_mask: torch.Tensor, eos: int) -> float:
    """TRL's training forward: prompt (left-padded) + completion up to its EOS; backward."""
    completion = seqs[:, prompt_mask.shape[1] :]
    done = (completion == eos).long().cumsum(1)
    keep = (done == 0) | ((done == 1) & (completion == eos))
    mask = torch.cat([prompt_mask, keep.long()], 1)
    model.train()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = model(input_ids=seqs, attention_mask=mask)
    out.logits.logsumexp(-1).mul(mask).sum().backward()
    return time.perf_counter() - start


def measure(path: Path, dtype: torch.dtype, rounds: int, n: int, new: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = policy(path)
    spec = load_spec(str(path))
    batch = prompts(tok, n, 4)
    warm = rollout(model, batch, dtype, new)  # first-call costs out of both timings
    train_pass(model, warm, batch["attention_mask"], tok.eos_token_id)
    off = ShiftRecorder(model, spec)
    layers: list[LayerShift] = []
    times = {"off": 0.0, "replay": 0.0}
    replayed = compared = 0
    for seed in range(rounds):
        torch.manual_seed(seed)
        seqs = rollout(model, batch, dtype, new)
        times["off"] += train_pass(model, seqs, batch["attention_mask"], tok.eos_token_id)
        layers += off.take()
        off.replay = True  # the same rows again, routed to the rollout's experts
        times["replay"] += train_pass(model, seqs, batch["attention_mask"], tok.eos_token_id)
        again = off.take()
        replayed, compared = replayed + off.replayed, compared + sum(x.tokens for x in again)
        off.replayed, off.replay = 0, False
    return summarise(layers, times, replayed, compared, rounds)


def summarise(
    layers: list[LayerShift], times: dict[str, float], replayed: int, compared: int, rounds: int
) -> dict[str, Any]:
    per: dict[int, list[int]] = {}
    for x in layers:
        acc = per.setdefault(x.layer, [0, 0, 0])
        acc[0], acc[1], acc[2] = acc[0] + x.tokens, acc[1] + x.differ, acc[2] + x.differ_top1
    shares = {k: (d / t, d1 / t) for k, (t, d, d1) in sorted(per.items())}
    return {
        "tokens": sum(t for t, _, _ in per.values()) // max(len(per), 1),
        "set": sum(s for s, _ in shares.values()) / len(shares),
        "top1": sum(s for _, s in shares.values()) / len(shares),
        "worst": max(shares.items(), key=lambda kv: kv[1][0]),
        "replayed": replayed / compared if compared else 0.0,
        "off_s": times["off"] / rounds,
        "replay_s": times["replay"] / rounds,
    }


def row(name: str, dtype: str, r: dict[str, Any]) -> str:
    layer, (worst, _) = r["worst"]
    return (
        f"| {name} | {dtype} | {r['tokens']} | {r['set']:.2%} | {r['top1']:.2%} | "
        f"{worst:.2%} (layer {layer}) | {r['replayed']:.0%} | {r['off_s']:.3f} | "
        f"{r['replay_s']:.3f} | {r['replay_s'] / r['off_s']:.2f}× |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="1 round, 2 prompts, no record")
    ap.add_argument("--record", action="store_true", help="append to results/grpo-and-methods.md")
    bench_env.add_argument(ap)
    args = ap.parse_args()
    bench_env.apply()
    rounds, n, new = (1, 2, 4) if args.smoke else (args.rounds, 8, 16)
    lines = [
        f"[{bench_env.describe()}; {rounds} rounds of {n} prompts × 4, {new} new tokens]",
        "| model | rollout | tokens/layer | top-k set differs | top-1 differs | worst layer "
        "| replayed (of compared) | train s off | train s replay | replay / off |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo (qwen3_moe)": SHIPPED_DIR, "deepseek_v3 tiny": tiny_deepseek(Path(tmp))}
        for name, path in models.items():
            for dtype in (torch.float32, torch.bfloat16):
                r = measure(path, dtype, rounds, n, new)
                lines.append(row(name, str(dtype).removeprefix("torch."), r))
                print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.record and not args.smoke:
        bench_env.append_results(
            RESULTS, HEAD, f"{time.strftime('%Y-%m-%d')}\n\n" + "\n".join(lines)
        )


if __name__ == "__main__":
    main()
