"""moetune as a library: the CLI's entry functions, typed, taking the same RunConfig
(docs/api.md). `moetune` forwards these names lazily, so `import moetune` stays cheap."""

from moetune.api.callbacks import callbacks
from moetune.api.config import run_config
from moetune.api.load import Loaded, load
from moetune.api.stages import eval_run, export_run, gate_results, lint_run, plan_run, train_run
