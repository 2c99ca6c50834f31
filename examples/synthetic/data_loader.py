"""Data loader of the synthetic example: generates and sends the training stream once.

Run by ``persia-launcher data-loader`` (REPLICA_INDEX / REPLICA_SIZE split the batches between
several loaders: loader i sends batches i, i + size, ...). Stream and size: see persia_batches.py.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import case_batch  # noqa: E402
from persia_batches import RunSettings, case_from_env, make_batch  # noqa: E402

from persia.ctx import DataCtx  # noqa: E402
from persia.env import get_replica_index, get_replica_size  # noqa: E402


def main() -> None:
    s = RunSettings.from_env()
    case = case_from_env().name
    index, size = get_replica_index(), get_replica_size()
    with DataCtx() as ctx:
        for i in range(index, s.train_batches, size):
            ctx.send_data(make_batch(*case_batch(case, i, s.batch_size, s.seed)))


if __name__ == "__main__":
    main()
