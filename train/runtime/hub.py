"""Whether the Hugging Face Hub can be reached, asked once before `datasets` or `huggingface_hub` is imported.
Offline, their clients retry every request for about 25 s before they fail; in offline mode they read the local
cache at once. So when the Hub's host does not answer a connection, offline mode is turned on for this process,
and an error can say that only the cache was read."""
from __future__ import annotations

import os
import socket
import sys
import urllib.parse

PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_switched: list[str] = []  # the host found unreachable, once offline mode was turned on here


def go_offline_if_unreachable(timeout_s: float = 3.0) -> None:
    """Set HF_HUB_OFFLINE=1 when the Hub (HF_ENDPOINT) refuses a connection or does not resolve. Left alone: a
    mode the user set, a proxy (which a direct connection cannot judge), and a process that imported the Hub
    client already (it has read its settings)."""
    if os.environ.get("HF_HUB_OFFLINE") or any(os.environ.get(p) for p in PROXIES) or "huggingface_hub" in sys.modules:
        return
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout_s).close()
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        _switched.append(url.hostname or "")


def note() -> str:
    """What an error about a Hub name adds when only the local cache was read ('' when the Hub was asked)."""
    if _switched:
        return f"{_switched[0]} cannot be reached from here, so only the local Hugging Face cache was read"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return "HF_HUB_OFFLINE is set, so only the local Hugging Face cache was read"
    return ""
