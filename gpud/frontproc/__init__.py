"""Front ends in processes of their own (`--http-processes N`): each parses and validates requests, places their
tensors in shared memory where the device worker reads them, and hands the core (in the daemon's process) a compact
description; the core only batches, dispatches and completes.

- `link`: the framed socket between a front-end process and the core, and the messages on it.
- `arena`: a front-end process's shared memory for the tensors it hands over.
- `group`: which requests of one turn go to the core as one (their rows together), and their answer split back.
- `remote_core`: what a front-end process serves over: an InferenceCore that asks the real one through the link.
- `host`: the core's side: starts, supervises and stops the front-end processes, and answers them.
- `child`: a front-end process's entry point (`python -m gpud.frontproc.child`).
"""
