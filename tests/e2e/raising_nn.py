"""An NN worker for tests/e2e/test_bad_batches.py: the adult example's training and evaluation, with a
model that raises on a marked batch (a dense value equal to MARK), as a model meeting input it cannot
handle does. Prints the example's JSON result line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ADULT = Path(__file__).resolve().parents[2] / "examples" / "adult-income"
sys.path.insert(0, str(ADULT))

import torch  # noqa: E402
import train as adult  # noqa: E402
from model import DNN  # noqa: E402
from persia_nats.common.logs import configure_logging  # noqa: E402

from persia.env import get_rank  # noqa: E402

MARK = 12345.0


class RaisesOnMarked(DNN):
    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        if bool((non_id_tensors[0] == MARK).any()):
            raise ValueError("a marked batch")
        return super().forward(non_id_tensors, embedding_tensors)


def main() -> None:
    configure_logging(os.environ.get("LOG_LEVEL", "info"), role="nn-worker", rank=get_rank())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = RaisesOnMarked(dense_dim=5)
    result = adult.train(model)
    if get_rank() == 0:
        result.update(adult.evaluate(model))
    del result["losses"]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
