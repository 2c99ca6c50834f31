"""``python -m persia_nats.services.serving``: one inference server,
exactly as ``persia-launcher serve`` (the same flags and exit statuses)."""

from __future__ import annotations

import sys

from persia_nats.services.serving.main import main

if __name__ == "__main__":
    sys.exit(main())
