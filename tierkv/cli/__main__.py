"""``python -m tierkv.cli``: the ``tierkv`` command."""

from tierkv.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
