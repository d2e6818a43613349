"""Where model instances go: the translation of gpud's models, devices and live instances into the placement
engine's problem (inputs, pure), the checks of a requested placement (requested), loads on demand and evictions
(ondemand), the service that plans and applies placements (service) and its answers (results)."""
