"""The cost model's parts, one concern a module; :mod:`verl_digen.sim.cost_model` composes them
into :class:`~verl_digen.sim.cost_model.CostModel` and re-exports every name (import from there).

- :mod:`.profiles`: the profile records (model, device, system, reward) and the workload;
- :mod:`.catalog`: reading profile files into a catalog (and the calibration's overrides);
- :mod:`.cluster`: where the pools sit (:class:`~.cluster.Cluster`) and the training pool as FSDP
  sees it (:class:`~.cluster.TrainGroup`);
- :mod:`.shapes`: tokens, FLOPs and parameter bytes of the workload;
- :mod:`.fsdp_traffic`: the training group of a cluster and its FSDP collectives;
- :mod:`.memory_fit`: memory as the memory planner decides it (what fits, checkpointing, parked
  optimizer state);
- :mod:`.memory_bytes`: what a training rank holds, its pass size, another system's fit estimated;
- :mod:`.phases`: generate (encode, denoise, decode), training passes and the optimizer step;
- :mod:`.rewards`: scoring, a swapped reward model, the reward model's bytes;
- :mod:`.weight_sync`: the weights' ways between pools and modes (stream, snapshot, sync, reload,
  offload, mode switch);
- :mod:`.elastic`: the per-group costs TAG decides its share with, GAT's micro-batches;
- :mod:`.tasks`: the task interface (``task_seconds``, modes, TSP's trained-step split);
- :mod:`.bounds`: the zero-bubble bound and the cluster's price.
"""
