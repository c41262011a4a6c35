"""`python -m kimi.plan` (kimi/plan/cli.py)."""

import sys

from kimi.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
