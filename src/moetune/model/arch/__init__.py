"""Family implementations; importing this package registers every family."""

from moetune.model.arch import dense, gqa, hybrid, mla

__all__ = ["dense", "gqa", "hybrid", "mla"]
