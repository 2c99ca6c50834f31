"""Data loader of the adult-income example: sends the training split once, shuffled.

Run by ``persia-launcher data-loader`` (REPLICA_INDEX / REPLICA_SIZE split the rows between
several loaders). ``EPOCHS`` (default 1) sends it that many times, each pass shuffled anew.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from adult_data import batches, load_split  # noqa: E402
from persia_batches import make_batch  # noqa: E402

from persia.ctx import DataCtx  # noqa: E402
from persia.env import get_replica_index, get_replica_size  # noqa: E402

BATCH_SIZE = int(os.environ.get("BATCH_SIZE", "128"))
SEED = int(os.environ.get("SEED", "0"))
EPOCHS = int(os.environ.get("EPOCHS", "1"))


def main() -> None:
    train = load_split("train")
    index, size = get_replica_index(), get_replica_size()
    if EPOCHS < 1:
        raise SystemExit(f"EPOCHS must be at least 1, got {EPOCHS}")
    with DataCtx() as ctx:
        for epoch in range(EPOCHS):
            # epoch 0 keeps the seed the single-pass runs and the reference use
            for i, (ids, dense, labels) in enumerate(batches(train, BATCH_SIZE, shuffle_seed=SEED + epoch)):
                if i % size == index:
                    ctx.send_data(make_batch(ids, dense, labels))


if __name__ == "__main__":
    main()
