"""``python -m hetlb``: the ``hetlb`` command."""
import sys

from hetlb.cli.commands import main


if __name__ == "__main__":
    sys.exit(main())
