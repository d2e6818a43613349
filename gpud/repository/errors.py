"""The error every reader of the model repository raises: the file at fault, the line when known, the problem."""
from __future__ import annotations

import os


class ModelConfigError(ValueError):
    """A model that cannot be served as configured. The message starts with the file at fault.

    `path` is that file (config.pbtxt, the ONNX file, or the model/version directory), `line` the 1-based line in
    config.pbtxt when the parser knows it, `problem` the message without the location.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, *, line: int | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.line = line
        where = f"{self.path}: line {line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")
