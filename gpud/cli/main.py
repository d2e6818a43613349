"""`gpudctl COMMAND`: the dispatcher."""
from __future__ import annotations

import sys

COMMANDS = {"inspect": "show devices, placements, queues and latencies of a running gpud",
            "place": "plan a placement of model instances on devices (offline or live)",
            "check": "validate this node end to end: readings against nvidia-smi, the serving path on each device",
            "load": "load (or reload) a model of the running gpud's repository",
            "unload": "unload a model from the running gpud",
            "log": "show or change what the running gpud logs (levels, verbose level, timestamp format)",
            "trace": "show or change which requests the running gpud traces; sum up a trace file",
            "mig": "MIG layout advice: recommend a layout per GPU for a set of models, list MIG profiles"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: gpudctl {{{','.join(COMMANDS)}}} [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<8} {text}")
        print("\n'gpudctl COMMAND --help' for a command's options. Where gpud is: --url or GPUD_URL (HTTP), --socket "
              "or GPUD_ADMIN_SOCKET (its admin socket); the admin token: --token-file or GPUD_ADMIN_TOKEN_FILE")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "inspect":
        from gpud.cli.inspect import inspect_main

        return inspect_main(argv[1:])
    if argv[0] == "check":
        from gpud.cli.check import check_main

        return check_main(argv[1:])
    if argv[0] in ("load", "unload"):
        from gpud.cli.models import models_main

        return models_main(argv[0], argv[1:])
    if argv[0] == "log":
        from gpud.cli.logs import log_main

        return log_main(argv[1:])
    if argv[0] == "trace":
        from gpud.cli.trace import trace_main

        return trace_main(argv[1:])
    if argv[0] == "mig":
        from gpud.cli.mig import mig_main

        return mig_main(argv[1:])
    from gpud.cli.place import place_main

    return place_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
