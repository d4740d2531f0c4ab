"""The secrets a launch carries – `lane.env` entries such as HF_TOKEN or WANDB_API_KEY, and
the provider's credentials such as the RunPod API key – and the one rule for them: they
reach the pod only through its process environment (the provider's env at create, or at
each exec), never through a file, a staged config, a ledger row, a printed plan or an error
message. What is shown or stored carries
`***` in their place (the ledger's own redaction, told these values too).
"""

from __future__ import annotations

from collections.abc import Mapping

from moetune.config import RunConfig
from moetune.errors import MoetuneError
from moetune.lane.providers import provider_class
from moetune.ledger import env_secrets, is_secret, redact


def plain_env(env: Mapping[str, str]) -> dict[str, str]:
    """The entries of `env` that are not secrets (what a staged config may keep)."""
    return {k: v for k, v in env.items() if not is_secret(k, v)}


def launch_secrets(cfg: RunConfig) -> list[str]:
    """Every secret value a launch of `cfg` may meet: lane.env's, the provider's credentials
    (e.g. the RunPod API key), and the secret-named variables of this process's environment."""
    env = [v for k, v in cfg.lane.env.items() if is_secret(k, v)]
    keys = provider_class(cfg.lane.provider).secret_values(cfg.lane)
    return [*env, *keys, *env_secrets()]


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every known secret (and anything shaped like one) masked."""
    return str(redact(text, secrets))


def scrub_error(err: BaseException, secrets: list[str]) -> None:
    """Mask secrets in an exception before anyone prints it (cause, fix and args)."""
    if isinstance(err, MoetuneError):
        err.cause, err.fix = scrub(err.cause, secrets), scrub(err.fix, secrets)
    err.args = tuple(scrub(a, secrets) if isinstance(a, str) else a for a in err.args)
