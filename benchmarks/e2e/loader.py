"""bench_e2e's data loader: sends pre-generated synthetic batches as fast as the job takes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from bench_setup import SLOTS, make_batches, peak_rss_mb, settings  # noqa: E402

from persia.ctx import DataCtx  # noqa: E402
from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch  # noqa: E402


def main() -> None:
    batch_size, n, warmup = settings()
    data = make_batches(n + warmup, batch_size)
    with DataCtx(max_inflight=16) as ctx:
        for ids, dense, labels in data:
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID(s, np.ascontiguousarray(ids[:, i])) for i, s in enumerate(SLOTS)],
                non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)]))
    print(json.dumps({"role": "loader", "peak_rss_mb": peak_rss_mb()}), flush=True)


if __name__ == "__main__":
    main()
