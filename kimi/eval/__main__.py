"""`python -m kimi.eval`: see kimi/eval/cli.py."""

import sys

from kimi.eval.cli import main

sys.exit(main())
