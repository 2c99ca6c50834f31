"""``python -m persia_nats.services.data_loader``: a data loader (a script, or --from-stream),
exactly as ``persia-launcher data-loader`` (the same flags and exit statuses)."""

from __future__ import annotations

import sys

from persia_nats.services.data_loader.main import main

if __name__ == "__main__":
    sys.exit(main())
