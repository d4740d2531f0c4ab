"""Which files make a base's checkpoint is decided once (model/weight_files.checkpoint_files):
the shards its index names when it has one, else model.safetensors. A stale float
model.safetensors beside an FP8 release's shards is named and ignored by moetune's own loaders
(the run equals the run without it) and refused where transformers would read it; a tensor in
two files of the checkpoint is refused in one line naming it and both files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.stack_files import index_dir
from moetune.engine.stored.write import write_stored
from moetune.model.weight_files import (
    INDEX,
    SINGLE,
    WeightFileError,
    check_weight_files,
    checkpoint_files,
)
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny float base, its FP8 release in several shards with an index, and the data."""
    root = tmp_path_factory.mktemp("ckpt")
    float_dir = save_tiny_model(root / "float")
    fp8 = write_stored(float_dir, root / "fp8", "fp8", block=(8, 8), shard_bytes=4096)
    data = write_jsonl(root / "d.jsonl", reverse_rows(16))
    return {"float": float_dir, "fp8": fp8, "data": data}


def _with_stale_float(bases: dict[str, Path], out: Path) -> Path:
    """The FP8 release plus the float base's model.safetensors beside its shards (same keys)."""
    shutil.copytree(bases["fp8"], out)
    shutil.copy2(bases["float"] / SINGLE, out / SINGLE)
    return out


def _cfg(bases: dict[str, Path], base: Path, out: Path, **train: Any) -> Any:
    return run_config(base, bases["data"], out, lora__targets=["attention", "experts"],
                      max_steps=2, save_steps=2, **train)  # fmt: skip


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(run.rglob("adapter_model.safetensors"))))


def test_the_fixture_is_sharded_with_an_index(bases: dict[str, Path]) -> None:
    shards = checkpoint_files(bases["fp8"])
    assert len(shards) > 1 and (bases["fp8"] / INDEX).is_file()
    assert set(shards) == set(bases["fp8"].glob("*.safetensors"))


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_a_stale_float_file_beside_an_fp8_release_is_ignored(
    bases: dict[str, Path], tmp_path: Path, offload: str
) -> None:
    from moetune.train import train

    stale = _with_stale_float(bases, tmp_path / "fp8-stale")
    with one_thread():
        ours = train(_cfg(bases, stale, tmp_path / "stale", offload=offload), progress=False)
        ref = train(_cfg(bases, bases["fp8"], tmp_path / "ref", offload=offload), progress=False)
    mine, theirs = _adapter(tmp_path / "stale"), _adapter(tmp_path / "ref")
    assert mine.keys() == theirs.keys() and any("experts" in k for k in mine)
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    said = [w for w in ours.warnings if "ignored" in w]
    assert len(said) == 1 and SINGLE in said[0] and not any("ignored" in w for w in ref.warnings)
    quant = [json.loads((tmp_path / r / "quant.json").read_text()) for r in ("stale", "ref")]
    assert quant[0]["stored_bytes"] == quant[1]["stored_bytes"]  # not counted twice


def test_every_reader_keeps_to_the_index(bases: dict[str, Path], tmp_path: Path) -> None:
    stale = _with_stale_float(bases, tmp_path / "fp8-stale")
    names = [p.name for p in checkpoint_files(stale)]
    assert names == [p.name for p in checkpoint_files(bases["fp8"])] and SINGLE not in names
    index = index_dir(stale)
    assert {Path(s.path).name for s in index.values()} == {p.name for p in checkpoint_files(stale)}
    assert index.keys() == index_dir(bases["fp8"]).keys()


def _sharded_float(bases: dict[str, Path], out: Path) -> Path:
    """The float base split into two shards with an index (the layout save_pretrained writes
    past max_shard_size)."""
    shutil.copytree(bases["float"], out)
    tensors = load_file(str(out / SINGLE))
    (out / SINGLE).unlink()
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}  # fmt: skip
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(out / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _cli_train(cfg: Any, tmp_path: Path) -> Any:
    from typer.testing import CliRunner

    from moetune.cli import app

    (tmp_path / "run.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    return CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])


def test_a_key_in_two_shards_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    base = _sharded_float(bases, tmp_path / "dup")
    first, second = checkpoint_files(base)
    key = min(load_file(str(second)))
    moved = load_file(str(first)) | {key: load_file(str(second))[key] * 0}
    save_file(moved, str(first), metadata={"format": "pt"})
    for check in (check_weight_files, index_dir):
        with pytest.raises(WeightFileError) as caught:
            check(base)
        assert key in str(caught.value) and first.name in str(caught.value)
        assert second.name in str(caught.value)
    result = _cli_train(_cfg(bases, base, tmp_path / "run"), tmp_path)
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_a_float_file_transformers_would_read_instead_is_refused(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    base = _sharded_float(bases, tmp_path / "sharded")
    stale = load_file(str(bases["float"] / SINGLE))
    save_file({k: v * 0 for k, v in stale.items()}, str(base / SINGLE), metadata={"format": "pt"})
    result = _cli_train(_cfg(bases, base, tmp_path / "run"), tmp_path)
    assert result.exit_code == 2, result.output
    assert SINGLE in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_another_weight_file_beside_a_single_file_base_is_named(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    base = shutil.copytree(bases["float"], tmp_path / "base")
    shutil.copy2(base / SINGLE, base / "consolidated.safetensors")
    assert checkpoint_files(base) == [base / SINGLE]
    (note,) = check_weight_files(base)
    assert "consolidated.safetensors" in note and "ignored" in note
    assert check_weight_files(bases["float"]) == []


def test_the_mlx_fused_dir_is_read_from_its_index(bases: dict[str, Path], tmp_path: Path) -> None:
    from moetune.export.mlx import _read_weights

    fused = _sharded_float(bases, tmp_path / "fused")
    stale = load_file(str(bases["float"] / SINGLE))
    save_file({k: v * 0 for k, v in stale.items()}, str(fused / SINGLE), metadata={"format": "pt"})
    read = _read_weights(fused)
    assert read.keys() == stale.keys()
    assert all(torch.equal(read[k], v) for k, v in stale.items())  # the shards, not the zeros
    first, second = checkpoint_files(fused)
    key = min(load_file(str(second)))
    save_file(load_file(str(first)) | {key: stale[key]}, str(first), metadata={"format": "pt"})
    with pytest.raises(WeightFileError, match=key.replace(".", r"\.")):
        _read_weights(fused)


def test_eval_reads_the_base_as_its_loader_does(
    bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moetune.evaluate.ladder import _check_base_files

    stale = _with_stale_float(bases, tmp_path / "fp8-stale")
    _check_base_files(_cfg(bases, stale, tmp_path / "a"), show=True)  # the stored loader
    assert "ignored" in capsys.readouterr().err
    sharded = _sharded_float(bases, tmp_path / "sharded")
    shutil.copy2(bases["float"] / SINGLE, sharded / SINGLE)
    with pytest.raises(WeightFileError, match="transformers"):  # from_pretrained would read it
        _check_base_files(_cfg(bases, sharded, tmp_path / "b"), show=True)


def test_the_mlx_view_links_only_the_checkpoint(bases: dict[str, Path], tmp_path: Path) -> None:
    from moetune.model import load_spec
    from moetune.train.mlx.base import _stage

    base = _sharded_float(bases, tmp_path / "sharded")
    shutil.copy2(bases["float"] / SINGLE, base / SINGLE)  # mlx-lm reads every model*.safetensors
    stage = tmp_path / "stage"
    stage.mkdir()
    _stage(base, stage, load_spec(str(base)))
    linked = {p.name for p in stage.glob("*.safetensors")}
    assert linked == {p.name for p in checkpoint_files(base)} and SINGLE not in linked
