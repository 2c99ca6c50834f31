"""``python -m persia_nats.services.embedding_worker``: one embedding worker,
exactly as ``persia-launcher embedding-worker`` (the same flags and exit statuses)."""

from __future__ import annotations

import sys

from persia_nats.services.embedding_worker.main import main

if __name__ == "__main__":
    sys.exit(main())
