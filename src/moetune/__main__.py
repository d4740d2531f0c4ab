"""`python -m moetune` – the CLI, for places where the console script is not on PATH (pods)."""

from moetune.train.distributed.orphans import die_with_launcher

die_with_launcher()  # a rank of `train --nproc`: first, before the CLI's seconds of imports

from moetune.cli import app  # noqa: E402

if __name__ == "__main__":
    app()
