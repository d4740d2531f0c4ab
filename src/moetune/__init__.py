"""moetune: fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right."""

__version__ = "0.1.0"


def register_experts() -> None:
    """Make `experts_implementation="moetune_lora"` loadable in your own script.

    Call it before `AutoModelForCausalLM.from_pretrained(..., experts_implementation=
    "moetune_lora")` (transformers checks the name at load); peft's LoRA on that model's
    fused experts (`LoraConfig(target_parameters=[...experts.gate_up_proj, ...down_proj])`)
    then trains on moetune's split-LoRA path, and the adapter stays a plain peft one.
    See docs/engine.md ("In your own script").
    """
    # lazy: heavy to import (torch, transformers, peft): `import moetune` stays light
    from moetune.engine.experts_lora import register

    register()
