"""Run llama.cpp's convert_hf_to_gguf.py on a tiny test model (interop tests only).

Usage: python gguf_convert_tiny.py LLAMA_CPP_DIR MODEL_DIR OUTFILE

The tiny models carry moetune's character tokenizer, whose pre-tokenizer hash llama.cpp
does not know (it refuses unknown BPE tokenizers). The checks feed token ids straight to
llama.cpp, so the vocabulary written here is a synthetic one of the model's size; every
tensor goes through the converter unchanged.
"""

import sys
from pathlib import Path


def synthetic_vocab(self) -> None:  # type: ignore[no-untyped-def]
    n = int(self.hparams["vocab_size"])
    writer = self.gguf_writer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"<t{i}>" for i in range(n)])
    writer.add_token_types([1] * n)
    writer.add_token_merges(["< t"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)


def main() -> None:
    root, model, outfile = sys.argv[1:4]
    sys.path.insert(0, root)
    sys.path.insert(1, str(Path(root) / "gguf-py"))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel._set_vocab_gpt2 = synthetic_vocab  # type: ignore[method-assign]
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", outfile, "--outtype", "f32"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
