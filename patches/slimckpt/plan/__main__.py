"""`python -m slimckpt.plan ...`: the same command as `slimckpt plan ...`."""

import sys

from slimckpt.log import cli_logging
from slimckpt.plan.cli import main

if __name__ == "__main__":
    with cli_logging():
        sys.exit(main())
