"""LoRA SFT of an MoE model that provably reaches the experts.

    from moetune.config import load_config
    from moetune.train import train

    result = train(load_config("run.yaml"), resume=False)
    result.adapter_dir, result.coverage, result.router_changed

`trainer` runs the stages top to bottom (preflight, data, LoRA + coverage audit, TRL's
SFTTrainer, adapter, summary); `data` reads TRL's row conventions from local files;
`routing` records expert load; `checkpoint` owns the run directory (atomic files,
committed checkpoints, resume); `callbacks` writes metrics and draws the progress bar.

Multi-GPU is accelerate's job: `moetune train run.yaml --nproc 4` (distributed.py writes
the accelerate config and launches), or directly

    accelerate launch --num_processes 4 -m moetune train run.yaml

runs the same `train()` on every process (data-parallel, each process on its shard of
every batch); only the main process writes the run directory, and a checkpoint is
committed only after every process has saved its part.

Names resolve lazily, so `import moetune.train.errors` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moetune.train.errors import DataError, TrainError
    from moetune.train.trainer import TrainResult, train

_WHERE = {
    "train": "trainer",
    "TrainResult": "trainer",
    "TrainError": "errors",
    "DataError": "errors",
}
__all__ = ["DataError", "TrainError", "TrainResult", "train"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'moetune.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moetune.train.{_WHERE[name]}"), name)
