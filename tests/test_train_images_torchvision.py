"""Image+text rows through the checkpoint's whole processor (opt-in: -m torchvision).

Every multimodal processor class of transformers 5.24 needs torchvision to construct; the
default suite runs without it (moetune then builds the class from its parts). Here each
tiny checkpoint is saved WITH its real processor – the class built from the tiny tokenizer
and its real image / video processors and audio feature extractor, saved into the checkpoint
dir as `save_pretrained` writes it – and moetune must load it through `AutoProcessor`, say
so, and train on image rows: coverage 1, router and vision tower unchanged, the tower run on
the pixels, labels on the assistant tokens only. Every multimodal type of the census is here
or named with its cause. Run from the torchvision venv (docs/data.md, "Image rows with
torchvision")."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from test_train_helpers import one_thread, run_config
from test_train_images import QWEN_TOKENS, TEMPLATE, _VisionCalls, image_rows, save_vl_model


def _torchvision_missing() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a wheel that does not match torch fails beyond ImportError
        return f"torchvision is not importable ({type(exc).__name__}); see docs/data.md"
    return None


pytestmark = [
    pytest.mark.torchvision,
    pytest.mark.skipif(_torchvision_missing() is not None, reason=str(_torchvision_missing())),
    pytest.mark.filterwarnings("ignore"),
]

GLM_TOKENS = dict(  # Glm4vProcessor reads the video markers off the tokenizer too
    image_start_token_id="<|begin_of_image|>",
    image_token_id="<|image|>",
    image_end_token_id="<|end_of_image|>",
    video_start_token_id="<|begin_of_video|>",
    video_token_id="<|video|>",
    video_end_token_id="<|end_of_video|>",
)
GEMMA4_NAMED = dict(  # Gemma4Processor reads these off the tokenizer, as its attributes
    image_token="<|image|>",
    boi_token="<|image>",
    eoi_token="<image|>",
    audio_token="<|audio|>",
    boa_token="<|audio>",
    eoa_token="<audio|>",
)
GEMMA4_TOKENS = dict(  # the config's fields for the same tokens (+ the video token it adds)
    image_token_id="<|image|>",
    boi_token_id="<|image>",
    eoi_token_id="<image|>",
    audio_token_id="<|audio|>",
    boa_token_id="<|audio>",
    eoa_token_index="<audio|>",
    video_token_id="<|video|>",
)
INKLING_TOKENS = {"image_token_id": "<|unused_200054|>"}  # Inkling2Processor's default
INKLING_MM_TOKENS = dict(  # InklingProcessor's defaults, image and audio
    image_token_id="<|unused_200054|>",
    audio_token_id="<|unused_200053|>",
    image_bos_token_id="<|content_image|>",
    audio_bos_token_id="<|content_audio_input|>",
)
MUSE_TOKENS = dict(  # MuseSparkProcessor's defaults (its image markers: in `markers`)
    image_token_id="<|patch|>", video_token_id="<|video|>", audio_token_id="<|audio|>"
)
MINIMAX_TOKENS = dict(  # MiniMaxM3VLProcessor's own spelling of its markers
    image_token_index="]<]image[>[", video_token_index="]<]video[>["
)
LLAMA4_TOKENS = dict(  # the config's fields: the features go to the patch tokens
    image_token_index="<|patch|>",
    boi_token_index="<|image_start|>",
    eoi_token_index="<|image_end|>",
)
# one 28x28 tile: 2x2 patches of 14, pixel-shuffled to one feature; the census' tower (width
# 48) counts but cannot run: its shuffle MLP takes hidden 64 / pixel_shuffle_ratio**2 = 256
LLAMA4_VISION = {"image_size": 28, "intermediate_size": 256}
LLAMA4_MARKERS = ("<|image|>", "<|tile_x_separator|>", "<|tile_y_separator|>")  # no field
MINIMAX_MARKERS = ("]<]start of image[>[", "]<]end of image[>[")  # no config field names them
ANSWERS = {"red<eos>", "blue<eos>", "green<eos>", "ba<eos>"}  # image_rows' assistant turns


def _patches(vision: Any) -> dict[str, Any]:
    """The Qwen-VL-style patch geometry of a vision config, as its processors name it."""
    return {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
    }


def _qwen_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    small = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    return {
        "image_processor": Qwen2VLImageProcessor(**_patches(vision), **small),
        "video_processor": Qwen3VLVideoProcessor(**_patches(vision)),
    }


def _glm_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Glm4vImageProcessor, Glm4vVideoProcessor

    small = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}
    return {
        "image_processor": Glm4vImageProcessor(**_patches(vision), **small),
        "video_processor": Glm4vVideoProcessor(**_patches(vision)),
    }


def _glm5_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Glm5NextImageProcessor, Glm5NextVideoProcessor

    small = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}
    return {
        "image_processor": Glm5NextImageProcessor(**_patches(vision), **small),
        "video_processor": Glm5NextVideoProcessor(**_patches(vision)),
    }


def _pixtral_parts(vision: Any, config: Any) -> dict[str, Any]:
    from transformers import PixtralImageProcessor

    patches = {"patch_size": vision.patch_size, "spatial_merge_size": config.spatial_merge_size}
    side = 2 * vision.patch_size * config.spatial_merge_size  # 2x2 merged tokens at most
    return {
        "image_processor": PixtralImageProcessor(
            patch_size=vision.patch_size, size={"longest_edge": side}
        ),
        **patches,
    }


def _inkling_parts(_vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Inkling2ImageProcessor

    return {"image_processor": Inkling2ImageProcessor()}  # 40x40: 2x2 patches of 20


def _inkling_mm_parts(_vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import InklingFeatureExtractor, InklingImageProcessor

    return {
        "image_processor": InklingImageProcessor(),
        "feature_extractor": InklingFeatureExtractor(),
    }


def _muse_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import (
        MuseGlimmerImageProcessor,
        MuseGlimmerVideoProcessor,
        MuseSparkFeatureExtractor,
    )

    geometry = {"patch_size": vision.patch_size, "merge_size": vision.merge_size}
    return {
        "image_processor": MuseGlimmerImageProcessor(**geometry, max_image_tokens=16),
        "video_processor": MuseGlimmerVideoProcessor(**geometry),
        "feature_extractor": MuseSparkFeatureExtractor(),
    }


def _gemma4_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessor, Gemma4VideoProcessor

    geometry = {"patch_size": vision.patch_size, "pooling_kernel_size": vision.pooling_kernel_size}
    return {  # 70 soft tokens per image: the smallest budget the processor accepts
        "image_processor": Gemma4ImageProcessor(**geometry, max_soft_tokens=70),
        "video_processor": Gemma4VideoProcessor(**geometry, max_soft_tokens=70),
        "feature_extractor": Gemma4AudioFeatureExtractor(),
    }


def _minimax_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor

    small = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
    return {
        "image_processor": MiniMaxM3VLImageProcessor(**_patches(vision), **small),
        "video_processor": MiniMaxM3VLVideoProcessor(**_patches(vision)),
    }


def _hy_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import HYV4VLImageProcessor, HYV4VLVideoProcessor

    geometry = {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size}
    small = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}
    return {
        "image_processor": HYV4VLImageProcessor(**geometry, **small),
        "video_processor": HYV4VLVideoProcessor(**geometry),
    }


def _ocr_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import UnlimitedOcrImageProcessor

    side = vision.sam_config.image_size  # one global view the size of the SAM encoder's input
    return {
        "image_processor": UnlimitedOcrImageProcessor(
            size={"height": side, "width": side}, crop_to_patches=False, tile_size=side
        ),
        "patch_size": vision.sam_config.patch_size,
    }


def _llama4_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Llama4ImageProcessor

    side = vision.image_size  # one tile the tower's size: no tiling, one global view
    return {
        "image_processor": Llama4ImageProcessor(size={"height": side, "width": side},
                                                max_patches=1),
        "patch_size": vision.patch_size,
        "pixel_shuffle_ratio": vision.pixel_shuffle_ratio,
    }  # fmt: skip


def _step_parts(vision: Any, _config: Any) -> dict[str, Any]:
    from transformers import Step3p7ImageProcessor

    side = 4 * vision.patch_size  # one feature after the tower's two stride-2 downsamplers
    return {"image_processor": Step3p7ImageProcessor(size={"height": side, "width": side},
                                                     patch_size=side)}  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """What a model type's processor needs: its tokens (config field -> token), the image
    placeholder its chat template writes, its non-tokenizer parts (and processor arguments)
    from the vision config and the whole config, the tokens its tokenizer carries as named
    attributes, its vision tower's name in `.model` (or in the model, where it has none), a
    row length that holds an image's tokens and the answer after them, the special tokens it
    reads that no config names, the changes its tiny vision config needs to run."""

    tokens: dict[str, str]
    placeholder: str
    parts: Callable[..., dict[str, Any]]
    named: dict[str, str] = field(default_factory=dict)
    tower: str = "visual"
    seq_len: int = 64
    markers: tuple[str, ...] = ()
    vision: dict[str, Any] = field(default_factory=dict)

    @property
    def template(self) -> str:
        return TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", self.placeholder)


QWEN = Kind(QWEN_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>", _qwen_parts)
KINDS = {
    "muse_spark": Kind(
        MUSE_TOKENS,
        "<|patch|>",
        _muse_parts,
        tower="vision_tower",
        markers=("<|image_start|>", "<|image_end|>"),
    ),
    "qwen3_vl_moe": QWEN,
    "qwen3_5_moe": QWEN,
    "qwen4_exp": QWEN,
    "glm4v_moe": Kind(GLM_TOKENS, "<|begin_of_image|><|image|><|end_of_image|>", _glm_parts),
    "glm5_next": Kind(GLM_TOKENS, "<|begin_of_image|><|image|><|end_of_image|>", _glm5_parts),
    "mistral_large4": Kind(
        {"image_token_index": "[IMG]"},
        "[IMG]",
        _pixtral_parts,
        tower="vision_tower",
        markers=("[IMG_BREAK]", "[IMG_END]"),
    ),
    "inkling2": Kind(INKLING_TOKENS, "<|unused_200054|>", _inkling_parts, tower="vision_tower"),
    "inkling2_loop": Kind(
        INKLING_TOKENS, "<|unused_200054|>", _inkling_parts, tower="vision_tower"
    ),
    "inkling_mm_model": Kind(
        INKLING_MM_TOKENS,
        "<|content_image|><|unused_200054|>",
        _inkling_mm_parts,
        tower="vision_tower",
    ),
    "llama4": Kind(
        LLAMA4_TOKENS,
        "<|image|>",
        _llama4_parts,
        tower="vision_model",
        markers=LLAMA4_MARKERS,
        vision=LLAMA4_VISION,
    ),
    "minimax_m3_vl": Kind(
        MINIMAX_TOKENS,
        MINIMAX_MARKERS[0] + "]<]image[>[" + MINIMAX_MARKERS[1],
        _minimax_parts,
        tower="vision_tower",
        markers=MINIMAX_MARKERS,
    ),
    "hy_v4_vl": Kind(
        {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"},
        "<|image_pad|>",
        _hy_parts,
        tower="vision_tower",
    ),
    "step3p7": Kind(
        {"image_token_id": "<im_patch>"},
        "<im_patch>",
        _step_parts,
        tower="vision_model",
        markers=("<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>"),
    ),
    "unlimited_ocr": Kind(
        {"image_token_id": "<image>"}, "<image>", _ocr_parts, tower="vision_tower"
    ),
    # Gemma4 resizes every image up to its budget: 60 tokens for a 32x48 PNG, + boi / eoi
    "gemma4": Kind(GEMMA4_TOKENS, "<|image|>", _gemma4_parts, GEMMA4_NAMED, "vision_tower", 128),
}


# the census' multimodal types left out, each with its cause (transformers 5.24 itself)
NOT_HERE = {
    "qwen3_omni_moe": "its class has no forward of its own: moetune trains the thinker",
    "qwen3_omni_moe_thinker": "no processor class is mapped to it, and its forward fails",
    "diffusion_gemma": "a block-diffusion forward with no labels: refused (its text model trains)",
}


def _name_tokens(out: Path, named: dict[str, str], markers: tuple[str, ...]) -> None:
    """The tokenizer's named multimodal tokens, as published checkpoints save them, and its
    unnamed markers."""
    if markers:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        tok.add_special_tokens(
            {"additional_special_tokens": list(markers)}, replace_extra_special_tokens=False
        )
        tok.save_pretrained(out)
    if named:
        saved = out / "tokenizer_config.json"
        values = json.loads(saved.read_text())
        saved.write_text(json.dumps({**values, "extra_special_tokens": named}))


def save_with_processor(model_type: str, out: Path) -> str:
    """A tiny checkpoint with its processor class built from its parts and saved beside it;
    the class's name."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    kind = KINDS[model_type]
    config = save_vl_model(model_type, out, kind.tokens, kind.template, kind.vision)
    name = PROCESSOR_MAPPING_NAMES[model_type]
    _name_tokens(out, kind.named, kind.markers)
    parts = kind.parts(config.vision_config, config)
    tok = AutoTokenizer.from_pretrained(out)
    getattr(transformers, name)(
        tokenizer=tok, **parts, chat_template=kind.template
    ).save_pretrained(out)
    return str(name)


@pytest.mark.parametrize("model_type", sorted(KINDS))
def test_the_checkpoints_own_processor_loads_via_autoprocessor_and_trains(
    model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    from moetune.model.derive import checkpoint_class
    from moetune.train.trainer import train
    from moetune.train.vision import ImageCollator

    base, tower = tmp_path / "model", KINDS[model_type].tower
    name = save_with_processor(model_type, base)
    cls = checkpoint_class(AutoConfig.from_pretrained(base))
    with torch.device("meta"):
        built = cls._from_config(AutoConfig.from_pretrained(base))
        tower_cls = type(_tower(built, tower))
    seen = _VisionCalls(tower_cls)
    monkeypatch.setattr(tower_cls, "forward", seen.forward)
    batches: list[dict[str, Any]] = []
    collate = ImageCollator.__call__
    monkeypatch.setattr(ImageCollator, "__call__", lambda s, rows: _kept(batches, collate(s, rows)))

    cfg = run_config(base, image_rows(tmp_path / "data", n=6), tmp_path / "run", max_steps=3,
                     save_steps=3, seq_len=KINDS[model_type].seq_len)  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert (result.steps, result.coverage, result.router_changed) == (3, 1.0, False)
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["processor"] == {"class": name, "via": "AutoProcessor", "without": []}
    assert seen.calls >= 3  # the tower ran on the pixels in every training step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = _tower(cls.from_pretrained(base), tower).state_dict()
    after = seen.tower.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    _assert_labels_on_answers(batches, base)


def test_every_multimodal_type_of_the_census_is_here_or_named_with_its_cause() -> None:
    from moetune.model.census import multimodal_model_types

    assert sorted(KINDS.keys() | NOT_HERE.keys()) == multimodal_model_types()
    assert not KINDS.keys() & NOT_HERE.keys()


def test_gemma4_rows_a_short_seq_len_leaves_no_answer_in_stop_before_training(tmp_path):
    """Gemma4 fills its image-token budget (60 for a 32x48 PNG): at seq_len 64 row 1 keeps
    no token of its answer, which stops the run in one line instead of training on nothing."""
    from moetune.data.errors import DataError
    from moetune.train.trainer import train

    save_with_processor("gemma4", tmp_path / "model")
    data = image_rows(tmp_path / "data", n=2)
    cfg = run_config(tmp_path / "model", data, tmp_path / "run", max_steps=1, seq_len=64)
    with one_thread(), pytest.raises(DataError) as err:
        train(cfg, progress=False)
    assert "train.seq_len 64 holds no token of its answer after its 60 image tokens" in (
        err.value.cause
    )


def _tower(model: Any, name: str) -> Any:
    """The vision tower: under `.model`, or beside the language model where a class has no
    `.model` (Llama4ForConditionalGeneration)."""
    return getattr(model, "model", model).get_submodule(name)


def _kept(batches: list[dict[str, Any]], batch: dict[str, Any]) -> dict[str, Any]:
    batches.append(dict(batch))  # a copy: the trainer pops labels off the one it gets
    return batch


def _assert_labels_on_answers(batches: list[dict[str, Any]], base: Path) -> None:
    """Every row the trainer saw learns exactly its assistant answer; image rows hold image
    tokens, which never carry a label."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(base)
    image_rows_seen = 0
    for batch in batches:
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            assert proc.tokenizer.decode(ids[labels != -100]) in ANSWERS
            images = ids == proc.image_token_id
            assert not (labels[images] != -100).any()
            image_rows_seen += int(images.any())
        assert "pixel_values" in batch or not (batch["input_ids"] == proc.image_token_id).any()
    assert image_rows_seen >= 1
