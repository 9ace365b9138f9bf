"""The cost model's parts, one concern a module; :mod:`verl_digen.sim.cost_model` composes them
into :class:`~verl_digen.sim.cost_model.CostModel` and re-exports every name (import from there).

- :mod:`.profiles`: the profile records (model, device, system, reward) and the workload;
- :mod:`.catalog`: reading profile files into a catalog (and the calibration's overrides);
- :mod:`.cluster`: where the pools sit (:class:`~.cluster.Cluster`) and the training pool as FSDP
  sees it (:class:`~.cluster.TrainGroup`).
"""
