"""`python -m hypic.serve [options]`: the OpenAI-compatible server (see --help)."""
from __future__ import annotations

import sys

from hypic.serve.server import main

if __name__ == "__main__":
    sys.exit(main())
