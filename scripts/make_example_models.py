#!/usr/bin/env python3
"""Write the example models gpud serves when given no repository (what ./scripts/run serves: mlp, cnn, two_input and
the ensemble pipeline with its steps preprocess, classifier and postprocess) into a Triton-layout model repository.

    python scripts/make_example_models.py [OUT_DIR]      # default: examples/model_repository
"""
from __future__ import annotations

import argparse
import os
import sys

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpud.examples import EXAMPLES, PIPELINE, write_served_examples  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default="examples/model_repository", help="repository to write into")
    parser.add_argument("--model", action="append", choices=sorted([*EXAMPLES, PIPELINE]),
                        help=f"only this model (repeatable; {PIPELINE}: the ensemble and its steps)")
    args = parser.parse_args(argv)
    for path in write_served_examples(args.out_dir, args.model):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
