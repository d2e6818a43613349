"""How gpudctl reaches a running gpud: one default address for every command, `GPUD_URL` to change it, and errors a
person can act on."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


class GpudUnreachable(RuntimeError):
    """gpud could not be reached or refused the call; the message says which and what to check."""


def base_url(url: str | None = None) -> str:
    """`url`, else $GPUD_URL, else DEFAULT_URL; `host:port` gets http:// in front."""
    base = (url or os.environ.get("GPUD_URL") or DEFAULT_URL).rstrip("/")
    return base if "://" in base else "http://" + base


def fetch_inspect(url: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET <url>/v2/gpud/inspect."""
    target = base_url(url) + "/v2/gpud/inspect"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise GpudUnreachable(f"{target}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GpudUnreachable(f"cannot reach gpud at {url or base_url()}: {reason} (is it running? see --url)") \
            from None


def admin_headers(token_file: str | None = None) -> dict[str, str]:
    """The Authorization header for gpud's admin actions (gpud --admin-token-file): the token in `token_file`, else
    in $GPUD_ADMIN_TOKEN_FILE; none when neither is set."""
    path = token_file or os.environ.get("GPUD_ADMIN_TOKEN_FILE")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return {"Authorization": f"Bearer {f.read().strip()}"}
    except OSError as exc:
        raise GpudUnreachable(f"cannot read the admin token file {path}: {exc.strerror or exc}") from None


def post_json(url: str | None, path: str, body: Any, timeout_s: float = 300.0,
              token_file: str | None = None) -> dict[str, Any]:
    """POST a JSON body (with the admin token, if one is configured); gpud's refusal comes back as GpudUnreachable
    with its status and error message."""
    target = base_url(url) + path
    req = urllib.request.Request(target, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **admin_headers(token_file)})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            message = ""
        raise GpudUnreachable(f"gpud refused it (HTTP {e.code}): {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise GpudUnreachable(f"cannot reach gpud at {url or base_url()}: {getattr(e, 'reason', e)}") from None
