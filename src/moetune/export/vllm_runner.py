"""Run by the vLLM venv's python (not imported by moetune): load a LoRA into a vLLM engine
on CPU and print the deltas its LoRA manager holds.

stdin: {"model", "engine" (LLM kwargs from vllm.json's flags), "request" (LoRARequest fields)}
stdout (last line): {"deltas": {module: [[...]]}} – ΔW = B @ A per module vLLM registered, the
MoE ones per expert and projection – or {"refused": vLLM's error} when it rejects the adapter.
"""

import json
import sys

MOE_PARTS = ("gate_proj", "down_proj", "up_proj")  # vLLM's packed MoE order: w1, w2, w3
MOE_3D_PARTS = ("gate_up_proj", "down_proj")  # its 3-D wrapper (e.g. gpt_oss): w13 fused, w2


def held_deltas(worker):
    """ΔW per module from the adapter the worker's LoRA manager registered (id 1)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    lora = manager._registered_adapters[1]
    out = {}
    for name, weights in lora.loras.items():
        out.update(module_deltas(name, weights, manager.packed_modules_mapping))
    return out


def module_deltas(name, weights, packed):
    """ΔW = B @ A (what set_lora copies: vLLM has folded every scaling into B by now);
    packed layers (qkv_proj, MoE w1/w2/w3 as [E, r, in] / [E, out, r]; the 3-D wrapper's
    w13/w2) split into parts."""
    a, b = weights.lora_a, weights.lora_b
    if not isinstance(a, list):
        return {name: (b.double() @ a.double()).tolist()}
    stem, _, leaf = name.rpartition(".")
    out = {}
    if a[0] is not None and a[0].dim() == 3:
        for part, ai, bi in zip(MOE_PARTS if len(a) == 3 else MOE_3D_PARTS, a, b, strict=True):
            for e in range(ai.shape[0]):
                out[f"{name}.{e}.{part}"] = (bi[e].double() @ ai[e].double()).tolist()
        return out
    parts = packed.get(leaf, [f"{leaf}.{i}" for i in range(len(a))])
    for part, ai, bi in zip(parts, a, b, strict=True):
        if ai is not None:
            out[f"{stem}.{part}"] = (bi.double() @ ai.double()).tolist()
    return out


def main() -> None:
    # lazy: heavy to import (vllm)
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=64,
              max_num_seqs=1, skip_tokenizer_init=True, gpu_memory_utilization=0.05,
              **job["engine"])  # fmt: skip
    try:
        llm.llm_engine.add_lora(LoRARequest(**job["request"]))
    except Exception as err:  # vLLM's refusal, reported as its own message
        print(json.dumps({"refused": f"{type(err).__name__}: {err}"}))
        return
    deltas = llm.collective_rpc(held_deltas)[0]
    print(json.dumps({"deltas": deltas}))


if __name__ == "__main__":
    main()
