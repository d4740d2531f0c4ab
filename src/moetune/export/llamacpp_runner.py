"""Run by the llama.cpp venv's python (not imported by moetune): llama.cpp scores token
sequences and greedy-decodes prompts with a GGUF model (+ optional GGUF LoRA), through
whichever binding that venv holds (BINDINGS, keyed by the module that imports):
llama-cpp-python (`llama_cpp`, built from source) or llama-cpp-py-sync (`llama_cpp_py_sync`,
a prebuilt CPU libllama wheel with CFFI over llama.h).

stdin: {"model", "lora" (or null), "sequences", "prompts", "new_tokens"}
stdout: {"logits": [[[...V] per position] per sequence], "greedy": [[ids] per prompt],
         "runtime": "<binding> <version>"}
"""

import importlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

N_CTX = 256
THREADS = 2
F32 = 0  # ggml_type GGML_TYPE_F32: the KV cache (llama.cpp's default f16 alone costs ~4e-4)
LOG_ERROR = 4  # ggml_log_level GGML_LOG_LEVEL_ERROR


def llama_cpp_python(job):
    """llama-cpp-python's Llama with every position's logits."""
    # lazy: heavy to import (numpy, llama_cpp)
    import numpy as np
    from llama_cpp import Llama

    kwargs = {"lora_path": job["lora"]} if job.get("lora") else {}
    llm = Llama(model_path=job["model"], n_ctx=N_CTX, logits_all=True, verbose=False,
                n_threads=THREADS, seed=0, type_k=F32, type_v=F32, **kwargs)  # fmt: skip

    def score(ids):
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    return score


class SyncLlama:
    """llama.h through llama-cpp-py-sync's CFFI library: model, context (f32 KV cache, no
    flash attention), the LoRA adapter at scale 1, and a batch that keeps every logit."""

    def __init__(self, job):
        # lazy: heavy to import (the CFFI library loads libllama)
        from llama_cpp_py_sync._cffi_bindings import get_ffi

        self.ffi = get_ffi()
        self.lib = self.ffi.dlopen(libllama())
        self.errors = []
        self.log = self.ffi.callback("void(enum ggml_log_level, const char *, void *)", self.keep)
        self.lib.llama_log_set(self.log, self.ffi.NULL)
        self.lib.llama_backend_init()
        params = self.lib.llama_model_default_params()
        self.model = self.checked(
            self.lib.llama_model_load_from_file(job["model"].encode(), params), job["model"]
        )
        self.ctx = self.checked(self.lib.llama_init_from_model(self.model, self.params()), "ctx")
        if job.get("lora"):
            self.apply(job["lora"])
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))

    def keep(self, level, text, _user):
        """llama.cpp's log: its errors are kept for the failure message, the rest dropped."""
        if level == LOG_ERROR:
            self.errors.append(self.ffi.string(text).decode(errors="replace").strip())

    def checked(self, pointer, what):
        if pointer == self.ffi.NULL:
            cause = self.errors[0] if self.errors else "no message"  # the first: the cause
            raise SystemExit(f"llama.cpp could not load {what}: {cause}")
        return pointer

    def params(self):
        params = self.lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = N_CTX
        params.n_threads = params.n_threads_batch = THREADS
        params.type_k = params.type_v = F32
        params.flash_attn_type = 0
        return params

    def apply(self, path):
        adapter = self.checked(self.lib.llama_adapter_lora_init(self.model, path.encode()), path)
        adapters = self.ffi.new("struct llama_adapter_lora *[1]", [adapter])
        if self.lib.llama_set_adapters_lora(self.ctx, adapters, 1, self.ffi.new("float[1]", [1.0])):
            raise SystemExit(f"llama.cpp could not apply {path}: {self.errors[-1:]}")

    def score(self, ids):
        # lazy: heavy to import (numpy)
        import numpy as np

        if len(ids) > N_CTX:  # llama_decode would abort the process, not return an error
            raise SystemExit(f"{len(ids)} tokens exceed the context of {N_CTX}")
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        batch = self.lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
                batch.seq_id[i][0] = 0
            if self.lib.llama_decode(self.ctx, batch) != 0:
                raise SystemExit(f"llama_decode failed: {self.errors[-1:]}")
            rows = [self.ffi.buffer(self.lib.llama_get_logits_ith(self.ctx, i), 4 * self.n_vocab)
                    for i in range(len(ids))]  # fmt: skip
            return np.array([np.frombuffer(r, dtype=np.float32) for r in rows], dtype=np.float64)
        finally:
            self.lib.llama_batch_free(batch)


# module that imports -> the libllama in its package that llama-cpp-py-sync's llama.h
# declarations drive: xllamacpp's extension module exports llama.h's C API from a
# manylinux_2_17 build (llama-cpp-py-sync's own libllama.so needs glibc 2.38 despite its tag)
LIBRARIES = {"xllamacpp": "xllamacpp.abi3.so", "llama_cpp_py_sync": "libllama.so"}


def library_module():
    return next(m for m in LIBRARIES if importlib.util.find_spec(m) is not None)


def libllama():
    module = library_module()
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    if origin is None:
        raise SystemExit(f"{module} has no package directory here")
    return str(Path(origin).with_name(LIBRARIES[module]))


def llama_cpp_py_sync(job):
    return SyncLlama(job).score


# module that imports -> scorer factory (job -> score(ids) -> [T, V] float64 logits)
BINDINGS = {"llama_cpp": llama_cpp_python, "llama_cpp_py_sync": llama_cpp_py_sync}
DISTRIBUTIONS = {"llama_cpp": "llama-cpp-python", "llama_cpp_py_sync": "llama-cpp-py-sync",
                 "xllamacpp": "xllamacpp"}  # fmt: skip


def runtime(module):
    """What served: the binding's distribution and version (and the libllama it drove)."""
    name = f"{DISTRIBUTIONS[module]} {importlib.metadata.version(DISTRIBUTIONS[module])}"
    if module == "llama_cpp_py_sync" and library_module() != module:
        return f"{name} on {runtime(library_module())}"
    return name


def binding():
    """(name, factory) of the first binding this python can import."""
    for module, factory in BINDINGS.items():
        if importlib.util.find_spec(module) is not None:
            return module, factory
    raise SystemExit(
        "no llama.cpp binding here: pip install xllamacpp llama-cpp-py-sync (make "
        "setup-llamacpp) or llama-cpp-python"
    )


def main() -> None:
    # lazy: heavy to import (numpy)
    import numpy as np

    job = json.load(sys.stdin)
    module, factory = binding()
    score = factory(job)

    def greedy(prompt, new):
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(np.argmax(score(ids)[-1])))
        return ids[len(prompt) :]

    out = {
        "logits": [score(s).tolist() for s in job["sequences"]],
        "greedy": [greedy(p, job["new_tokens"]) for p in job["prompts"]],
        "runtime": runtime(module),
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
