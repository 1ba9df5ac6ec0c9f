"""``python -m hpar_trainer`` / ``hpar-train``: works under torchrun and as a single process."""

from __future__ import annotations

import sys


def main() -> None:
    from .train import main as train_main

    sys.exit(train_main())


if __name__ == "__main__":
    main()
