"""Run by the llama.cpp venv's python (not imported by moetune): llama-cpp-python scores
token sequences and greedy-decodes prompts with a GGUF model (+ optional GGUF LoRA).

stdin: {"model", "lora" (or null), "sequences", "prompts", "new_tokens"}
stdout: {"logits": [[[...V] per position] per sequence], "greedy": [[ids] per prompt]}
"""

import json
import sys


def main() -> None:
    # lazy: heavy to import (numpy, llama_cpp)
    import numpy as np
    from llama_cpp import Llama

    job = json.load(sys.stdin)
    kwargs = {"lora_path": job["lora"]} if job.get("lora") else {}
    # KV cache in f32 (type 0; llama.cpp's default f16 alone costs ~4e-4 relative logits)
    llm = Llama(model_path=job["model"], n_ctx=256, logits_all=True, verbose=False,
                n_threads=2, seed=0, type_k=0, type_v=0, **kwargs)  # fmt: skip

    def score(ids):
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    def greedy(prompt, new):
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(np.argmax(score(ids)[-1])))
        return ids[len(prompt) :]

    out = {
        "logits": [score(s).tolist() for s in job["sequences"]],
        "greedy": [greedy(p, job["new_tokens"]) for p in job["prompts"]],
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
