import sys

from kimi.ablate import main

sys.exit(main())
