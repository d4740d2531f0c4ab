"""moetune: fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right."""

__version__ = "0.1.0"
