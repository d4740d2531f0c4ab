"""The census by tier, recorded: of the installed transformers' decoder MoE types, how many
moetune counts exactly, recipes at 100 %, plans analytically, traces exactly and trains
five steps (moetune.bench.census). Trace and train take long on a laptop, so their results
are written to benchmarks/census_tiers.json, which docs/plan.md quotes and
tests/test_census_tiers.py checks.

    python benchmarks/census_tiers.py [--tiers count,recipe,plan,trace,train]
                                      [--types a,b] [--smoke]

--smoke runs the cheap tiers on three types and writes nothing. --types re-records only
the named types (the others keep their statuses; `rerecorded` in the file says which, when).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import bench_env

RECORD = Path(__file__).with_name("census_tiers.json")
SMOKE_TYPES = ["qwen3_moe", "mixtral", "olmoe"]


def _record(statuses: dict, seconds: float) -> dict:
    import torch
    import transformers

    from moetune.bench.census import tier_counts

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {bench_env.describe()}",
        "seconds": round(seconds),
        "types": len(statuses),
        "passed": tier_counts(statuses),
        "statuses": statuses,
    }


def _merge(record: dict) -> dict:
    """Tiers measured now replace the same tiers of the file; the others stay."""
    if not RECORD.exists():
        return record
    old = json.loads(RECORD.read_text(encoding="utf-8"))
    if old.get("transformers") != record["transformers"]:
        return record
    for model_type, tiers in record["statuses"].items():
        record["statuses"][model_type] = {**old["statuses"].get(model_type, {}), **tiers}
    from moetune.bench.census import tier_counts

    record["passed"] = tier_counts(record["statuses"])
    record["types"] = len(record["statuses"])
    return record


def _partial(record: dict, tiers: tuple[str, ...], types: list[str]) -> dict:
    """A re-record of some types: the whole record's date, machine and time stay; the
    re-recorded types, tiers, date and seconds are listed under `rerecorded`."""
    old = json.loads(RECORD.read_text(encoding="utf-8"))
    if old.get("transformers") != record["transformers"]:
        return record  # another library: nothing to keep
    step = {k: record[k] for k in ("date", "seconds")} | {"tiers": list(tiers), "types": types}
    record["statuses"] = {**old["statuses"], **record["statuses"]}  # the others stay
    merged = _merge(record)
    for key in ("date", "machine", "seconds"):
        merged[key] = old[key]
    merged["rerecorded"] = [*old.get("rerecorded", []), step]
    return merged


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="count,recipe,plan,trace,train")
    parser.add_argument("--smoke", action="store_true", help="cheap tiers, 3 types, no file")
    parser.add_argument("--types", default="", help="re-record only these types (a,b)")
    bench_env.add_argument(parser)
    args, _ = parser.parse_known_args(argv)
    bench_env.apply()
    from moetune.bench.census import CHEAP, census_tiers

    tiers = CHEAP if args.smoke else tuple(t for t in args.tiers.split(",") if t)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        types = [t for t in args.types.split(",") if t] or None
        statuses = census_tiers(tiers, Path(work), SMOKE_TYPES if args.smoke else types)
    record = _record(statuses, time.perf_counter() - start)
    print(json.dumps({"passed": record["passed"], "types": record["types"]}))
    for model_type, found in statuses.items():
        for tier, said in found.items():
            if said != "ok":
                print(f"{model_type} {tier}: {said}")
    if not args.smoke:
        partial = types is not None and RECORD.exists()
        record = _partial(record, tiers, types) if partial else _merge(record)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
