"""The card catalog: required ids, PyTorch-visible capacities, lookup and its error."""

from __future__ import annotations

import pytest

from moetune.errors import UnknownCardError
from moetune.plan.hardware import GiB, all_cards, card_for_device, card_ids, get_card
from moetune.plan.overhead import ALLOCATOR_FRACTION, overhead_for

REQUIRED = [
    "H200", "H100-NVL", "H100-80GB", "A100-80GB", "A100-40GB", "L40S", "RTX-4090",
    "RTX-5090", "B200", "DGX-Spark", "M3-Max-128GB", "M4-Max-64GB", "M2-Ultra-192GB",
    "M3-Ultra-512GB",
]  # fmt: skip


def test_catalog_has_every_required_card() -> None:
    assert set(REQUIRED) <= set(card_ids())


def test_h100_80gb_shows_about_79_gib_to_pytorch() -> None:
    card = get_card("H100-80GB")
    # "80GB" on the box is 80 GiB of HBM; PyTorch reports 79.11 GiB (84.94e9 bytes)
    assert card.usable_bytes < 80 * GiB
    assert card.usable_bytes == pytest.approx(79.11 * GiB, rel=1e-3)
    assert card.usable_bytes < card.memory_bytes


def test_every_card_is_documented_and_usable_is_below_marketed() -> None:
    for card in all_cards():
        assert 0 < card.usable_bytes < card.memory_bytes, card.id
        assert card.notes and card.tensor_tflops > 0, card.id
        assert card.kind in ("cuda", "unified", "mps"), card.id


def test_runpod_ids_and_memory_of_datacenter_cards() -> None:
    assert get_card("H200").runpod_gpu_type_id == "NVIDIA H200"
    assert get_card("H100-NVL").runpod_gpu_type_id == "NVIDIA H100 NVL"
    assert get_card("H100-80GB").runpod_gpu_type_id == "NVIDIA H100 80GB HBM3"
    assert get_card("A100-80GB").runpod_gpu_type_id == "NVIDIA A100 80GB PCIe"
    assert get_card("B200").runpod_gpu_type_id == "NVIDIA B200"
    assert get_card("H200").memory_bytes == 141 * GiB
    assert get_card("DGX-Spark").kind == "unified"


def test_apple_usable_is_the_metal_working_set_share() -> None:
    for card_id in ("M3-Max-128GB", "M4-Max-64GB", "M2-Ultra-192GB", "M3-Ultra-512GB"):
        card = get_card(card_id)
        assert card.kind == "mps"
        assert card.usable_bytes / card.memory_bytes == pytest.approx(0.75)
        assert card.runpod_gpu_type_id is None


def test_lookup_is_case_insensitive() -> None:
    assert get_card("h100-nvl").id == "H100-NVL"
    assert get_card(" rtx-4090 ").id == "RTX-4090"


@pytest.mark.parametrize(
    ("device", "card"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA GB10", "DGX-Spark"),
        ("nvidia  h200", "H200"),
        ("NVIDIA A100-SXM4-80GB", None),  # not the catalog's PCIe board: no near guess
        ("NVIDIA H100 PCIe", None),
        ("cpu", None),
        (None, None),
    ],
)
def test_torch_device_names_match_catalog_cards(device: str | None, card: str | None) -> None:
    assert card_for_device(device) == card


def test_unknown_card_names_the_ids() -> None:
    with pytest.raises(UnknownCardError) as err:
        get_card("H300")
    assert "H300" in err.value.cause
    assert "H100-80GB" in err.value.fix and "M3-Max-128GB" in err.value.fix


def test_overhead_terms_by_kind() -> None:
    live = 79_000_000_000
    cuda = overhead_for("cuda", live)
    assert set(cuda.terms) == {"cuda_context", "cublas_workspace", "allocator"}
    assert cuda.terms["cuda_context"] == 512 * 1024**2
    assert cuda.terms["allocator"] == round(ALLOCATOR_FRACTION * live)
    # calibrated on a real run: 85 GB reserved for the 73.6 GiB (79.0e9 B) traced step
    assert 0.07 < ALLOCATOR_FRACTION < 0.08
    mps = overhead_for("mps", live)
    assert "cuda_context" not in mps.terms and mps.total < cuda.total
    assert overhead_for("unified", live).terms == cuda.terms  # DGX Spark runs CUDA


def test_host_links_and_nodes_of_the_cards() -> None:
    """Every discrete card has a host link and its usual node's RAM; unified memory none."""
    for card in all_cards():
        if card.kind == "cuda":
            assert card.host_link and card.host_link.gb_per_s > 0, card.id
            assert card.host_ram_bytes and card.gpus_per_node >= 1, card.id
        else:
            assert card.host_link is None, card.id  # offloading frees nothing there
    assert get_card("H100-80GB").host_link.gb_per_s == 50  # type: ignore[union-attr]
    assert get_card("A100-80GB").host_link.gb_per_s == 25  # type: ignore[union-attr]
    for grace in ("GH200-96GB", "GH200-144GB", "GB200"):
        assert get_card(grace).host_link.id == "nvlink-c2c"  # type: ignore[union-attr]
        assert get_card(grace).host_link.gb_per_s == 450  # type: ignore[union-attr]
    assert get_card("GH200-144GB").host_ram_bytes == 480e9
    assert get_card("GB200").memory_bytes == 186 * GiB  # one GPU of the superchip
    assert card_for_device("NVIDIA GH200 480GB") == "GH200-96GB"
