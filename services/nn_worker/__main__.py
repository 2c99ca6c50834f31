"""``python -m persia_nats.services.nn_worker``: the NN-worker ranks of a training script,
exactly as ``persia-launcher nn-worker`` (the same flags and exit statuses)."""

from __future__ import annotations

import sys

from persia_nats.services.nn_worker.main import main

if __name__ == "__main__":
    sys.exit(main())
