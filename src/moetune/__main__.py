"""`python -m moetune` – the CLI, for places where the console script is not on PATH (pods)."""

from moetune.cli import app

if __name__ == "__main__":
    app()
