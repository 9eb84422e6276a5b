"""``python -m edgeq``: the same as the ``edgeq`` command."""

import sys

from edgeq.cli import main

if __name__ == "__main__":
    sys.exit(main())
