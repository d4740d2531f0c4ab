"""The run config: typed sections grouped by concern (sections.py, lane.py, methods.py on
the shared field types of base.py), read from YAML with `--set` overrides (load.py)."""

from moetune.config.lane import LaneArgs, RunpodArgs, SkypilotArgs, SshArgs
from moetune.config.load import (
    dump_config,
    load_config,
    load_yaml,
    parse_config,
    read_config_text,
    schema_rows,
)
from moetune.config.methods import DpoArgs, GrpoArgs, RewardArgs
from moetune.config.sections import (
    TUNING_KINDS,
    DataArgs,
    EvalArgs,
    GateArgs,
    HardwareArgs,
    LoraArgs,
    ModelArgs,
    OutputArgs,
    RunConfig,
    RungArgs,
    SourceArgs,
    TrainArgs,
)

__all__ = [
    "TUNING_KINDS",
    "DataArgs",
    "DpoArgs",
    "EvalArgs",
    "GateArgs",
    "GrpoArgs",
    "HardwareArgs",
    "LaneArgs",
    "LoraArgs",
    "ModelArgs",
    "OutputArgs",
    "RewardArgs",
    "RunConfig",
    "RungArgs",
    "RunpodArgs",
    "SkypilotArgs",
    "SourceArgs",
    "SshArgs",
    "TrainArgs",
    "dump_config",
    "load_config",
    "load_yaml",
    "parse_config",
    "read_config_text",
    "schema_rows",
]
