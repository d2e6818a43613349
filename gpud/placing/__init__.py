"""Where model instances go: the translation of gpud's models, devices and live instances into the placement
engine's problem (inputs, pure), and the service that plans and applies placements (service)."""
