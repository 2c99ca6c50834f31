"""``python -m persia_nats.services.embedding_ps``: one PS replica,
exactly as ``persia-launcher embedding-parameter-server`` (the same flags and exit statuses)."""

from __future__ import annotations

import sys

from persia_nats.services.embedding_ps.main import main

if __name__ == "__main__":
    sys.exit(main())
