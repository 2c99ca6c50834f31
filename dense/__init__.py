"""The torch side that the NN worker and the inference service share: the tensors a dense model takes
(:mod:`.tensors`) and the dense part of a checkpoint (:mod:`.checkpoint`). The only layer besides the
roles that imports torch; it imports no NATS."""
