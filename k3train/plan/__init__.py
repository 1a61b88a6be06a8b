"""Plan a run before asking for hardware: `python -m k3train.plan [overrides] --gpus N --gpu h200|h100|b200|cpu`.

From the composed config and the model built on the meta device, per device: memory (parameters, gradients,
optimizer state, activations, transients), communication per step by kind, step time and throughput, and the
mesh to ask for. One module per job:
  spec.py         the composed config as a RunSpec: the meta model's parameters, their optimizer, the recipe
  costs.py        what the planner asks of a model family beyond its shapes (a protocol the model provides)
  mesh.py         dp_replicate x dp_shard x ep (x cp x pp), and the meshes a proposal tries
  hardware.py     the devices: vendor figures with their sources; the CPU measured
  activations.py  what a KimiK3 forward keeps for its backward, per layer, from the shapes
  memory.py       stored bytes, transients and each phase's peak per device
  comm.py         collectives per step: FSDP, DDP, EP, CP, Newton-Schulz, Quantile Balancing
  pipeline.py     parallel.pp: stages, the schedule's bubble, micro-batches in flight, the p2p bytes
  estimate.py     step time, throughput, the proposal (a pipeline: each pp rank planned as a run of its stages)
  search.py       when nothing fits: the recipes that do (precision, checkpointing, micro-batch, cp, mesh); the
                  fewest devices that fit
  report.py       the table and the JSON
How to use it and what it leaves out: docs/plan.md.
"""
