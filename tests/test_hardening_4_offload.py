"""Issue 48 (fourth hardening pass): NaN in a base's weights was blamed on the learning rate
("the run diverged … lower train.learning_rate"), offloaded expert stacks included. The
NaN loss is now traced to the frozen weight that holds it, in host RAM, on disk or resident."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.train.errors import TrainError
from test_train_helpers import reverse_rows, write_jsonl
from test_train_offload import _run, save_model

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def nan_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The offload tests' tiny base with one NaN in layer 2's expert stack."""
    root = tmp_path_factory.mktemp("nanbase")
    base = save_model(root / "model")
    weights = load_file(str(base / "model.safetensors"))
    name = next(k for k in sorted(weights) if "layers.2." in k and "down_proj" in k)
    weights[name].view(-1)[3] = float("nan")
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base, write_jsonl(root / "d.jsonl", reverse_rows(16)), name


@pytest.mark.parametrize("offload", ["cpu", "disk", "none"])
def test_nan_in_the_base_is_named_not_blamed_on_the_learning_rate(
    nan_base: tuple[Path, Path, str], tmp_path: Path, offload: str
) -> None:
    base, data, name = nan_base
    with pytest.raises(TrainError) as err:
        _run((base, data), tmp_path / "run", offload, max_steps=2, logging_steps=1)
    # the base's own name (peft's wrappers left out): the fused stack of layer 2
    assert "weight model.layers.2.mlp.experts.down_proj holds 1 NaN" in err.value.cause
    assert "not the learning rate" in err.value.cause and err.value.exit_code == 2
    assert "learning_rate" not in err.value.fix
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    assert torch.isnan(load_file(str(base / "model.safetensors"))[name]).sum() == 1
