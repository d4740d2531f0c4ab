"""The secrets a launch carries – every `lane.env` value not named in `lane.public_env`, and
the provider's credentials such as the RunPod API key – and the one rule for them: they
reach the pod only through its process environment (the provider's env at create, or at
each exec), never through a file, a staged config, a ledger row, a printed plan or an error
message. What is shown or stored carries
`***` in their place: the values are registered with the one masker (moetune.io), which
every writer, console, ledger row and error message applies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from moetune.config import RunConfig
from moetune.config.load import lane_secrets
from moetune.errors import MoetuneError
from moetune.io import register_secrets
from moetune.lane.providers import provider_class
from moetune.ledger import env_secrets, is_secret, redact
from moetune.plan.cost.walls import XET_ENV

MOETUNE_ENV = (XET_ENV,)  # the walls' own entries: moetune's settings, never a secret


def plain_env(env: Mapping[str, str], public: Iterable[str]) -> dict[str, str]:
    """The entries of `env` that are not secrets: named in `public` (lane.public_env, plus
    moetune's own walls) and neither secret-named nor secret-shaped."""
    names = {*public, *MOETUNE_ENV}
    return {k: v for k, v in env.items() if not is_secret(k, v, names)}


def launch_secrets(cfg: RunConfig) -> list[str]:
    """Every secret value a launch of `cfg` may meet – lane.env's non-public values, the
    provider's credentials (e.g. the RunPod API key), the secret-named variables of this
    process's environment – registered with the masker for the rest of the process."""
    keys = provider_class(cfg.lane.provider).secret_values(cfg.lane)
    found = [*lane_secrets(cfg), *keys, *env_secrets()]
    register_secrets(found)
    return found


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every known secret (and anything shaped like one) masked."""
    return str(redact(text, secrets))


def scrub_error(err: BaseException, secrets: list[str]) -> None:
    """Mask secrets in an exception before anyone prints it (cause, fix and args)."""
    if isinstance(err, MoetuneError):
        err.cause, err.fix = scrub(err.cause, secrets), scrub(err.fix, secrets)
    err.args = tuple(scrub(a, secrets) if isinstance(a, str) else a for a in err.args)
