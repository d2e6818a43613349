"""Everything that decides how many instances each model version runs: the bounds (`bounds`), the autoscaling hint
policy (`hints`, pure) and its sampler (`sampler`), the controller's rules (`rules`, pure) and its loop
(`controller`), idleness and eviction choices (`idle`, pure), and what a rescale did (`plan`). Carrying a decision
out is the placement service's (gpud.placing), which this package never imports."""
