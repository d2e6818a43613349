"""The admin token (`--admin-token-file`): when set, the actions that change what gpud serves (the repository API's
load and unload, `POST /v2/gpud/placement`) need `Authorization: Bearer <token>` (HTTP header, gRPC metadata).
Reading, inference and health never do."""
from __future__ import annotations

import hmac

from executor.types import ErrorKind, InferenceError


def read_token_file(path: str) -> str:
    """The token in the file (surrounding whitespace dropped); ValueError for an unreadable or empty file."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"admin token file {path}: {exc}") from None
    if len(token) < 16:
        raise ValueError(f"admin token file {path}: the token must be at least 16 characters (got {len(token)})")
    return token


class AdminAuth:
    def __init__(self, token: str | None = None):
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | None, action: str) -> None:
        """Raise UNAUTHENTICATED unless `authorization` ("Bearer <token>") carries the token, or none is set."""
        if self._token is None:
            return
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise InferenceError(ErrorKind.UNAUTHENTICATED,
                                 f"{action} needs the admin token: send 'Authorization: Bearer <token>' (gpudctl: "
                                 "--token-file or GPUD_ADMIN_TOKEN_FILE)")
