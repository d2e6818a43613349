"""Everything that decides how many instances each model version runs: the bounds (`bounds`), the autoscaling hint
policy (`hints`, pure) and its sampler (`sampler`), the controller's rules (`rules`, pure) and its loop
(`controller`), and idleness and eviction choices (`idle`, pure). Acting on a decision is the placement service's
(gpud.placing)."""
