"""Image+text rows: read and checked by the data package (paths against the data file, a
missing or broken image one line, exit 2), counted by `moetune data`, and trained on a tiny
multimodal checkpoint of transformers' own class with its own processor saved beside it –
the vision tower runs on the pixels, stays frozen and unchanged, the loss lies on the
assistant tokens only."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.data import DataError, check_sources
from test_train_helpers import one_thread, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
TEMPLATE = (  # Qwen-VL's image placeholder, in the demo tokenizer's alphabet
    "{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<eos>{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}


def _png(path: Path, colour: tuple[int, int, int], seed: int) -> str:
    from PIL import Image

    noise = np.random.default_rng(seed).integers(0, 30, (32, 48, 3))
    pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path.name


def image_rows(folder: Path, n: int = 8) -> Path:
    """n rows in both layouts (inline image blocks, an `images` column) + one text-only row,
    the PNGs under folder/img, named relative to the data file."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        name, colour = list(COLOURS.items())[i % len(COLOURS)]
        rel = f"img/{_png(folder / 'img' / f'{i}.png', colour, i)}"
        if i % 2:
            user = [{"type": "image", "image": rel}, {"type": "text", "text": "colour?"}]
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": name},
                    ]
                }
            )
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": "colour?"},
                        {"role": "assistant", "content": name},
                    ],
                    "images": [rel],
                }
            )
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "rev:ab"},
                {"role": "assistant", "content": "ba"},
            ]
        }
    )
    return write_jsonl(folder / "train.jsonl", rows)


QWEN_TOKENS = dict(  # config field -> the token it names, as Qwen-VL's processors expect
    vision_start_token_id="<|vision_start|>",
    image_token_id="<|image_pad|>",
    vision_end_token_id="<|vision_end|>",
    video_token_id="<|video_pad|>",
)


def save_vl_model(
    model_type: str,
    out: Path,
    tokens: dict[str, str],
    template: str = TEMPLATE,
    vision: dict[str, Any] | None = None,
) -> Any:
    """A tiny checkpoint of transformers' own multimodal class for `model_type` and the demo
    tokenizer with `tokens` (config field -> special token) added and set in the config, its
    vision config changed by `vision`; its config."""
    from transformers import CONFIG_MAPPING

    from moetune.demo.tokenizer import build_tokenizer
    from moetune.model.census import tiny_multimodal_config
    from moetune.model.derive import checkpoint_class

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tok.chat_template = template
    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    values.update({k: tok.convert_tokens_to_ids(t) for k, t in tokens.items()})
    if vision:
        values["vision_config"] = {**values["vision_config"], **vision}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[model_type](**values)
        for name in ("pad", "eos", "bos"):
            setattr(config.get_text_config(), f"{name}_token_id", getattr(tok, f"{name}_token_id"))
        torch.manual_seed(0)
        checkpoint_class(config)._from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return config


def save_vl_checkpoint(model_type: str, out: Path) -> Path:
    """A tiny checkpoint of transformers' own Qwen-VL-style multimodal class, with the files
    its processor loads from: the image processor's preprocessor_config.json (naming the
    processor class, as published checkpoints do), the tokenizer with the vision tokens and
    the chat template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vision = save_vl_model(model_type, out, QWEN_TOKENS).vision_config
    Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        min_pixels=32 * 32,
        max_pixels=64 * 64,
    ).save_pretrained(out)
    saved = out / "preprocessor_config.json"
    saved.write_text(
        json.dumps({**json.loads(saved.read_text()), "processor_class": "Qwen3VLProcessor"})
    )
    return out


def _run_yaml(tmp_path: Path, data: Path, model: Path) -> str:
    cfg = {
        "model": {"id": str(model)},
        "data": {"train_file": str(data)},
        "train": {"seq_len": 64, "batch_size": 2, "epochs": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


# ---------------------------------------------------------------- data


def test_both_layouts_resolve_against_the_data_file_and_moetune_data_counts_images(tmp_path):
    data = image_rows(tmp_path / "data", n=6)
    model = save_tiny_model(tmp_path / "m", chat_template=TEMPLATE)
    result = CliRunner().invoke(app, ["data", _run_yaml(tmp_path, data, model), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    summary = got.get("summary", got)
    assert summary["images"] == {"images": 6, "rows_with_images": 6, "per_row": {"0": 1, "1": 6}}
    text = CliRunner().invoke(app, ["data", _run_yaml(tmp_path, data, model)])
    assert "images: 6 in 6 of 7 rows" in text.stdout

    from moetune.config import parse_config

    parts, _ = check_sources(
        parse_config({"model": {"id": str(model)}, "data": {"train_file": str(data)}}).data
    )
    rows = [r for _, r in parts[0].rows]
    expected = str((tmp_path / "data" / "img" / "0.png").resolve())
    assert rows[0]["images"] == [expected]  # the column's path, against the file's folder
    assert rows[0]["messages"][0]["content"][0] == {"type": "image"}  # placed before the text
    assert rows[1]["messages"][0]["content"][0] == {"type": "image"}  # the inline path moved out
    assert rows[1]["images"] == [str((tmp_path / "data" / "img" / "1.png").resolve())]


def test_a_missing_image_is_one_line_naming_source_row_and_fix_exit_2(tmp_path):
    data = image_rows(tmp_path / "data", n=4)
    (tmp_path / "data" / "img" / "2.png").unlink()
    model = save_tiny_model(tmp_path / "m", chat_template=TEMPLATE)
    result = CliRunner().invoke(app, ["data", _run_yaml(tmp_path, data, model)])
    assert result.exit_code == 2
    assert "train.jsonl line 3" in result.output and "img/2.png not found" in result.output
    assert "relative to the data file" in result.output and "Traceback" not in result.output


def test_an_undecodable_image_and_a_count_mismatch_are_refused(tmp_path):
    from moetune.config import parse_config

    data = image_rows(tmp_path / "data", n=2)
    (tmp_path / "data" / "img" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    cfg = parse_config({"model": {"id": "x"}, "data": {"train_file": str(data)}})
    with pytest.raises(DataError) as err:
        check_sources(cfg.data)
    assert "line 2" in err.value.cause and "cannot be decoded" in err.value.cause

    empty = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{**empty, "images": []}])
    parts, _ = check_sources(cfg.data.model_copy(update={"train_file": str(plain)}))
    assert parts[0].rows[0][1] == empty  # an empty images column leaves a text row

    bare = {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}
    row = {"messages": [bare, {"role": "assistant", "content": "red"}], "images": ["img/0.png"]}
    one = write_jsonl(tmp_path / "data" / "one.jsonl", [row])
    with pytest.raises(DataError) as err:
        check_sources(cfg.data.model_copy(update={"train_file": str(one)}))
    assert "2 bare image blocks but 1" in err.value.cause


def test_image_rows_on_a_checkpoint_without_a_processor_stop_in_one_line(tmp_path):
    from moetune.train.errors import TrainError
    from moetune.train.vision import load_processor

    model = save_tiny_model(tmp_path / "m", chat_template=TEMPLATE)  # a text model: no processor
    with pytest.raises(TrainError) as err:
        load_processor(str(model))
    assert "image rows need" in err.value.cause and "processor" in err.value.cause
    assert "text-only rows" in err.value.fix and "\n" not in err.value.cause


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def vl_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vl_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("vl") / "model")


def test_the_collator_puts_image_tokens_and_pixels_in_and_loss_on_assistant_tokens(
    vl_base, tmp_path
):
    from moetune.train.vision import ImageCollator, load_processor

    processor, _ = load_processor(str(vl_base))
    image = str((tmp_path / "img" / _png(tmp_path / "img" / "r.png", COLOURS["red"], 0)).resolve())
    turns = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "again?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red 2"}]},
    ]
    text_row = {"messages": json.dumps(turns[2:]), "images": []}
    batch = ImageCollator(processor, 64)(
        [{"messages": json.dumps(turns), "images": [image]}, text_row]
    )
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape and ids.shape[0] == 2
    image_tokens = int((ids[0] == processor.image_token_id).sum())
    assert image_tokens == int(batch["image_grid_thw"].prod(-1).sum()) // 4 > 0  # 2x2 merge
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    tok = processor.tokenizer
    learnt = [tok.decode(ids[r][labels[r] != -100]) for r in range(2)]
    assert learnt == ["red<eos>red 2<eos>", "red 2<eos>"]
    assert int((labels[1] == -100).sum()) > int((ids[1] == tok.pad_token_id).sum())  # pad too


class _VisionCalls:
    """Counts the vision tower's forwards with gradients on (training steps, not the routing
    measurement under no_grad) and keeps the live tower."""

    def __init__(self, cls: type) -> None:
        self.calls, self.tower = 0, None
        original = cls.forward

        def forward(tower: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += int(torch.is_grad_enabled())
            self.tower = tower
            return original(tower, *args, **kwargs)

        self.forward = forward


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_image_rows_train_the_language_model_with_the_tower_frozen_and_run(
    model_type: str, tmp_path: Path, vl_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    from moetune.model.derive import checkpoint_class
    from moetune.train.trainer import train

    base = (
        vl_base if model_type == "qwen3_vl_moe" else save_vl_checkpoint(model_type, tmp_path / "m")
    )
    cls = checkpoint_class(AutoConfig.from_pretrained(base))
    with torch.device("meta"):
        tower_cls = type(cls._from_config(AutoConfig.from_pretrained(base)).model.visual)
    seen = _VisionCalls(tower_cls)
    monkeypatch.setattr(tower_cls, "forward", seen.forward)  # where the model's call binds it

    data = image_rows(tmp_path / "data", n=8)
    cfg = run_config(base, data, tmp_path / "run", max_steps=4, save_steps=4, seq_len=64)
    with one_thread():
        result = train(cfg, progress=False)
    assert (result.steps, result.coverage, result.router_changed) == (4, 1.0, False)
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    assert seen.calls >= 4  # pixel_values reached the tower in the training steps

    from safetensors.torch import load_file

    adapter = load_file(str(Path(result.adapter_dir) / "adapter_model.safetensors"))
    assert adapter and not [k for k in adapter if ".visual." in k]  # LoRA on the language model
    assert any(".experts." in k for k in adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = cls.from_pretrained(base).model.visual.state_dict()
    after = seen.tower.state_dict()
    assert not any(p.requires_grad for p in seen.tower.parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["data"]["images"]["images"] == 8
    from transformers.utils import is_torchvision_available

    # without torchvision the class is built from its parts, and the run says which
    via = "AutoProcessor" if is_torchvision_available() else "parts"
    assert (summary["processor"]["class"], summary["processor"]["via"]) == ("Qwen3VLProcessor", via)


def test_the_batch_joins_per_image_lists_a_processor_leaves_unconverted() -> None:
    """Per-token tensors padded, pixels concatenated, per-image lists (UnlimitedOcr's
    `patches_grid`, `num_local_patches`) joined in row order; a text row adds none."""
    from types import SimpleNamespace

    from moetune.train.vision import IGNORE, ImageCollator

    processor = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    ids = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]]), torch.tensor([[4, 4, 4, 4]])]
    rows: list[dict[str, Any]] = [{"input_ids": i, "labels": i.clone()} for i in ids]
    rows[0].update(pixel_values=torch.ones(2, 5), patches_grid=[[1, 2], [3, 4]])
    rows[2].update(pixel_values=torch.zeros(1, 5), patches_grid=[[5, 6]])
    out = ImageCollator(processor, 64).batch(rows)
    assert out["patches_grid"] == [[1, 2], [3, 4], [5, 6]]
    assert out["pixel_values"].sum(-1).tolist() == [5.0, 5.0, 0.0]
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [4, 4, 4, 4]]
    assert out["labels"][1].tolist() == [8, 9, IGNORE, IGNORE]


def test_a_seq_len_its_image_tokens_fill_stops_the_run_at_row_1(vl_base, tmp_path):
    from moetune.train.vision import ImageCollator, check_first_row, load_processor

    processor, _ = load_processor(str(vl_base))
    image = str((tmp_path / _png(tmp_path / "r.png", COLOURS["red"], 0)).resolve())
    turns = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    row = {"messages": json.dumps(turns), "images": [image]}
    ids = ImageCollator(processor, 64)([row])["input_ids"]
    image_tokens = int((ids == processor.image_token_id).sum())
    check_first_row(ImageCollator(processor, 64), [row], "train.jsonl")  # room for the answer
    with pytest.raises(DataError) as err:
        check_first_row(ImageCollator(processor, 4), [row], "train.jsonl")
    assert image_tokens > 0 and err.value.cause == (
        f"train.jsonl row 1: train.seq_len 4 holds no token of its answer after its "
        f"{image_tokens} image tokens, so it would train on nothing"
    )
    assert "raise train.seq_len" in err.value.fix
