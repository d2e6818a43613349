"""The placement controller's replay benchmark (issue 12): the Alibaba trace's load shifts against gpud's real
controller and planner on a simulated 8-GPU node, and four other policies. `python -m replay.run` from bench/."""
