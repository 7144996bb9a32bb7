"""Heterogeneous execution: which processor runs which part of a model, and running it so.

- units.py: a compiled graph cut into units (embedding, each transformer layer, output head)
  with the weight and KV-cache bytes each needs on each kind of processor;
- profile.py: per unit and processor, measured times (the model's own shapes) and a fitted cost
  model (bytes and FLOPs against measured bandwidth and throughput) for the rest, plus the cost of
  moving an activation between processors (and the all_reduce of a tensor-parallel step); cached
  on disk with the tuning cache;
- solver.py: under a memory budget per processor, the placement (and row / sequence splits) that
  minimises predicted decode time per token plus weighted prefill time, exactly (MILP);
- executor.py: runs a placed model, each segment on its processor's backend, KV caches in place
  on the processor that owns the layer;
- stream.py: the GPU's side of a CPU-held layer: its products multiplied on the GPU from weights
  streamed out of pinned host memory (every row of a prefill chunk; a share of each decode
  product's rows where asked);
- plan.load_placed: `edgellm run --gpu-memory SIZE`, a model planned and loaded in one call;
- distributed.py: the same placement over N processes (one per GPU) through torch.distributed,
  or tensor parallel (each process its share of every layer: ModelConfig.shard), the choice between
  them predicted by plan.plan_gpus.
"""
