"""An NN worker for tests/e2e/test_skipped_batches.py: the adult model, trained by a loop that leaves
batches out, as a loop that drops a batch with a non-finite loss does.

Rank 0 runs no backward for every third batch (after its forward), rank 1 for every second one from
its fourth on (without even a forward), so the ranks skip different steps and, now and then, the same
one. Prints one JSON line: rank, steps, skipped, counters, dense_sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ADULT = Path(__file__).resolve().parents[2] / "examples" / "adult-income"
sys.path.insert(0, str(ADULT))

import torch  # noqa: E402
from model import DNN  # noqa: E402
from persia_nats.common.logs import configure_logging  # noqa: E402

from persia.ctx import TrainCtx  # noqa: E402
from persia.data import DataLoader, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_device_id, get_rank  # noqa: E402


def main() -> None:
    rank = get_rank()
    configure_logging(os.environ.get("LOG_LEVEL", "info"), role="nn-worker", rank=rank)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DNN(dense_dim=5)
    loss_fn = torch.nn.BCELoss()
    steps = skipped = 0
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=1e-2),
                  dense_optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), device_id=get_device_id()) as ctx:
        for i, batch in enumerate(DataLoader(StreamingDataset(10), forward_buffer_size=4)):
            if rank == 1 and i >= 3 and i % 2 == 1:
                skipped += 1
                continue
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            if rank == 0 and i % 3 == 2:
                skipped += 1
                continue
            ctx.backward(loss)
            steps += 1
        ctx.wait_for_gradients()
        counters = dict(ctx.runtime.counters)
    state = b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())
    print(json.dumps({"rank": rank, "steps": steps, "skipped": skipped, "counters": counters, "device": str(ctx.device),
                      "dense_sha256": hashlib.sha256(state).hexdigest()}), flush=True)


if __name__ == "__main__":
    main()
