"""The maths every role shares, with no NATS and no torch: the PS table (:mod:`.store`, its hash
index and LRU kernels in :mod:`.table_kernels`), the embedding optimizers (:mod:`.optim`), batch
plans and pooling (:mod:`.plan`), float16 packing (:mod:`.half`), id sharding (:mod:`.sharding`)
and the table's checkpoint shards (:mod:`.store_checkpoint`).

A PS, an embedding worker, the NN worker's hot-row mirror and the inference service all run this
code, so a row found, updated or pooled in one place is found, updated or pooled the same way in
every other. ``tests/unit/test_layers.py`` keeps it free of NATS, torch and the roles' packages.
"""
