"""lane: where a run happens remotely – the provider sections and the cost guard's limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from moetune.config.base import (
    DiskSizeInt,
    NonNegativeInt,
    Percent,
    Port,
    PositiveFloat,
    PositiveInt,
    _Section,
)


class SshArgs(_Section):
    """An SSH host for provider `ssh` (OpenSSH; the host key is pinned per run on first use)."""

    host: str | None = Field(None, description="Host name or IP.")
    hosts: list[str] = Field(
        default_factory=list,
        description="Hosts of a multi-node run (train.nnodes > 1), node 0 first, each "
        "`[user@]host[:port]` (port and user default to the fields below); node 0's host is "
        "the address the others reach it at unless train.master_addr says otherwise.",
    )
    port: Port = Field(22, description="sshd port.")
    user: str = Field("root", description="Login user.")
    identity: str | None = Field(None, description="Private key file (ssh -i).")


class RunpodArgs(_Section):
    """RunPod pod settings for provider `runpod`; the API key is read, never logged."""

    api_key_env: str = Field("RUNPOD_API_KEY", description="Env var holding the API key.")
    config_file: str = Field(
        "~/.runpod/config.toml",
        description='File with `apikey = "..."` used when the env var is unset.',
    )
    api_url: str = Field("https://api.runpod.io/graphql", description="GraphQL endpoint.")
    image: str = Field(
        "runpod/pytorch:2.8.0-py3.11-cuda12.8.1-cudnn-devel-ubuntu22.04",
        description="Container image of the pod.",
    )
    cloud_type: Literal["ALL", "SECURE", "COMMUNITY"] = Field("ALL", description="Cloud.")
    container_disk_gb: DiskSizeInt = Field(
        30, description="Container disk (the volume is separate)."
    )
    gpu_count: PositiveInt | None = Field(
        None,
        description="GPUs per pod; default: train.nproc when > 1, else the fewest GPUs the "
        "per-device planner says the run fits on (1 without one).",
    )


class SkypilotArgs(_Section):
    """SkyPilot settings for provider `skypilot`; credentials stay SkyPilot's own (`sky check`)."""

    sky: str = Field(
        "sky", description="The SkyPilot CLI: a name on PATH or a path (e.g. its own venv)."
    )
    cloud: str | None = Field(None, description="Restrict to one cloud (aws, gcp, …); default any.")
    use_spot: bool = Field(False, description="Spot instances (cheaper; may be preempted).")
    image: str | None = Field(
        None, description="Docker image for the task (image_id docker:…); default the cloud's."
    )
    ssh_user: str = Field(
        "ubuntu", description="Login user on the cluster (SkyPilot's ~/.ssh/config alias)."
    )


# What YAML made of an unquoted env value, named in the refusal (never the value itself).
YAML_KINDS = {bool: "a true/false", int: "a number", float: "a number", list: "a list",
              dict: "a mapping", type(None): "an empty"}  # fmt: skip


def env_text(env: Any) -> Any:
    """lane.env as given, when every value is text; otherwise a refusal that names the entry
    and what YAML read it as, and never shows a value (each one may be a secret)."""
    if not isinstance(env, dict):
        return env  # pydantic's own type error (its input masked where it is shown)
    for name, value in env.items():
        if not isinstance(value, str):
            kind = YAML_KINDS.get(type(value), type(value).__name__)
            raise ValueError(f"{name} is {kind} value in YAML, and env values are text")
    return env


class LaneArgs(_Section):
    """Remote-run infrastructure: where the pod comes from, the four walls, the cost guard."""

    provider: Literal["local", "ssh", "runpod", "skypilot"] = Field(
        "local", description="Where to run."
    )
    volume_gb: DiskSizeInt | None = Field(
        None, description="Pod volume size in GB (default: sized from the model)."
    )
    watchdog_s: PositiveInt | None = Field(
        None, description="In-pod watchdog deadline in seconds (default: sized from the plan)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Env vars set in the pod. Every value is a secret (masked in all output "
        "and files, passed to the pod by its process environment only) unless its name is in "
        "lane.public_env.",
    )
    public_env: list[str] = Field(
        default_factory=list,
        description="Names of lane.env entries that are not secrets (shown, and kept in the "
        "pod's staged config); a secret-looking name or value stays masked all the same.",
    )

    _env_text = field_validator("env", mode="before")(env_text)

    ci_job_timeout_minutes: PositiveInt | None = Field(None, description="CI job timeout-minutes.")
    ci_step_timeout_minutes: PositiveInt | None = Field(
        None, description="Step-level timeout-minutes on the launch step."
    )
    estimated_eval_s: NonNegativeInt = Field(
        1800, description="Expected eval time on the pod, seconds."
    )
    max_usd: PositiveFloat | None = Field(
        None, description="Budget: at this spend, bank what exists, terminate, ledger row."
    )
    idle_gpu_percent: Percent = Field(
        5.0, description="GPU-idle watchdog: utilisation below this counts as idle."
    )
    idle_minutes: PositiveFloat = Field(
        20.0, description="GPU-idle watchdog: idle this long terminates the pod."
    )
    poll_s: PositiveFloat = Field(30.0, description="Seconds between controller checks of the pod.")
    ready_timeout_s: PositiveFloat = Field(
        900.0, description="Longest wait for a pod to accept SSH."
    )
    remote_moetune: str = Field(
        "moetune", description="Command that runs moetune on the pod (after lane.setup)."
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell commands run first on the pod (e.g. pip install moetune).",
    )
    workdir: str = Field(
        "moetune-runs", description="Base dir of run files on the pod (relative: under home)."
    )
    ssh: SshArgs = Field(
        default_factory=SshArgs,  # type: ignore[arg-type]
        description="Provider ssh: the host.",
    )
    runpod: RunpodArgs = Field(
        default_factory=RunpodArgs,  # type: ignore[arg-type]
        description="Provider runpod: pod settings.",
    )
    skypilot: SkypilotArgs = Field(
        default_factory=SkypilotArgs,  # type: ignore[arg-type]
        description="Provider skypilot: the CLI, cloud, spot and image of the cluster.",
    )
