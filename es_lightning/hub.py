"""The Hugging Face hub without long waits: probe it once, fall back to the local cache when it cannot be reached, and
turn "not cached and offline" / "no such repository" into one clear message naming the id and the fix.

Without this, a machine with no network (a cluster node, an air-gapped box) spends ~30 s per file in huggingface_hub's
retries (5 attempts, 8 s back-off) before transformers prints a 95-line traceback. Here a TCP connection to the hub's
host (or the HTTPS proxy) is tried once with a short timeout (``ES_LIGHTNING_HUB_TIMEOUT``, default 3 s); if it fails,
the process switches huggingface_hub and datasets to offline mode — exactly what ``HF_HUB_OFFLINE=1`` does — so files
already in the cache still load, and anything else fails at once with the hint.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from functools import lru_cache
from urllib.parse import urlparse

from lightning.pytorch.utilities import rank_zero_info

_TRUE = ("1", "true", "yes", "on")


def offline_requested() -> bool:
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """One TCP connection to the hub endpoint (``HF_ENDPOINT``) or the HTTPS proxy, with a short timeout."""
    from huggingface_hub import constants

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    timeout = float(os.environ.get("ES_LIGHTNING_HUB_TIMEOUT", "3"))
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """What ``HF_HUB_OFFLINE=1`` does, for this process and its children (the libraries read it at import)."""
    import datasets.config
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True


def prepare_hub_access() -> None:
    """Call before loading anything from the hub: switches to the local cache when the hub cannot be reached."""
    if offline_requested():
        return
    if not hub_reachable():
        from huggingface_hub import constants

        rank_zero_info(f"{constants.ENDPOINT} cannot be reached: using the local Hugging Face cache only (HF_HUB_OFFLINE=1)")
        go_offline()


def _names(exc: BaseException) -> set[str]:
    out, seen = set(), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.add(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return out


def describe_hub_error(exc: BaseException, repo: str | None = None, kind: str = "model",
                       revision: str | None = None, local_fix: str | None = None) -> str | None:
    """One line for a hub failure (offline and not cached, unknown or gated repository, unknown revision), or
    ``None``. With a ``revision`` the download command fetches that one (``hf download`` fetches ``main``, which the
    load then still did not find). ``local_fix`` words the way out through a local copy (a model's default: the
    recipe's ``model:``, :data:`MODEL_FIX_LOCAL`; a script's call: :func:`es_lightning.policy.model_fix_local`)."""
    names = _names(exc)
    text = str(exc)
    what = f"{kind} {repo!r}" if repo else f"the {kind}"
    if revision is not None:
        what += f" at revision {revision!r}"
    if "RevisionNotFoundError" in names or "is not a valid git identifier" in text:
        return f"{what}: the repository has no such branch, tag or commit on the Hugging Face hub; check revision"
    fix_local = local_fix or (MODEL_FIX_LOCAL if kind == "model" else "point data.source at a local file or directory")
    if "GatedRepoError" in names:
        return f"{what} is gated on the Hugging Face hub: accept its terms on huggingface.co, then `hf auth login`"
    if names & {"RepositoryNotFoundError", "DatasetNotFoundError"} or "is not a valid model identifier" in text:
        return (f"{what} is neither a local path nor a repository on the Hugging Face hub (misspelt? private: `hf auth "
                f"login`); {fix_local}")
    if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or "couldn't connect to" in text.lower() or (
        "Couldn't reach" in text
    ):
        return (f"{what} is not in the local Hugging Face cache and the hub cannot be reached (offline): download it on a "
                f"machine with network (`hf download {repo or 'ID'}{' --repo-type dataset' if kind == 'dataset' else ''}"
                f"{f' --revision {revision}' if revision is not None else ''}`) "
                f"and copy the cache (HF_HOME), or {fix_local}")
    return None


#: a hub model's refusal's local fix, in a fit's terms (an analysis command, whose models are not ``model:``, gives its own)
MODEL_FIX_LOCAL = "point model: at a local directory"


@contextlib.contextmanager
def hub_errors(repo: str, kind: str = "model", revision: str | None = None,
               local_fix: str | None = None) -> Iterator[None]:
    """Load from the hub inside; a hub failure becomes ``ConnectionError`` / ``FileNotFoundError`` with one clear line
    ending with ``local_fix``, the way out through a local copy in the words of whoever was given the model or
    dataset (:func:`describe_hub_error`)."""
    prepare_hub_access()
    try:
        yield
    except (OSError, ValueError) as err:
        line = describe_hub_error(err, repo, kind, revision, local_fix)
        if line is None:
            raise
        raise (ConnectionError(line) if "offline" in line else FileNotFoundError(line)) from err
