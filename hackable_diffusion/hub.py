"""A model argument -> a local directory: a folder as given, or a Hugging Face Hub id resolved by `huggingface_hub`.

`resolve_model_path("google/diffusiongemma-26B-A4B-it")` looks in the local Hugging Face cache first and downloads
only what is missing (the weights, config and tokenizer files; never the other files of the repository). With
`HF_HUB_OFFLINE=1` nothing is downloaded: a cached snapshot resolves, anything else is a one-line
`CheckpointError`. Nothing here touches the network unless the argument is a Hub id that is not cached.
"""

from __future__ import annotations

import os
import re

from hackable_diffusion.errors import CheckpointError

# `owner/name` (optionally `@revision`): the form of a Hub model id; anything else is a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# what a DiffusionGemma checkpoint needs (a repository may hold much more, e.g. other precisions)
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt")
_TRUE = ("1", "on", "yes", "true")


def hub_offline() -> bool:
  """`HF_HUB_OFFLINE` as set now (read at each call, not when huggingface_hub was imported)."""
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_model_path(id_or_path: str, *, cache_dir: str | None = None) -> str:
  """A local directory holding the checkpoint `id_or_path` names.

  A path that exists is returned as given. A Hub id (`owner/name`, optionally `@revision`) is resolved through
  `huggingface_hub.snapshot_download`: the local cache (`cache_dir`, default `$HF_HUB_CACHE` or
  `$HF_HOME/hub`) first; offline (`HF_HUB_OFFLINE`) only the cache. Raises a one-line `CheckpointError` for a
  missing path, a Hub id that is not cached while offline, or one the Hub does not have.
  """
  path = os.fspath(id_or_path)
  if os.path.exists(path):
    return path
  if not _HUB_ID.match(path):
    raise CheckpointError(f"{path}: no such checkpoint directory (nor a Hugging Face Hub id 'owner/name')")
  try:
    import huggingface_hub
    from huggingface_hub import errors as hub_errors
  except ImportError:
    raise CheckpointError(f"{path}: no such directory; to load it as a Hugging Face Hub id install "
                          "huggingface_hub (pip install huggingface_hub)") from None
  repo_id, _, revision = path.partition("@")
  offline = hub_offline()
  cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or (
      os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
  try:
    return huggingface_hub.snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir,
                                             local_files_only=offline, allow_patterns=list(ALLOW_PATTERNS))
  except hub_errors.LocalEntryNotFoundError:
    if offline:
      raise CheckpointError(f"{repo_id}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it "
                            "once with network access (or pass a local directory)") from None
    raise CheckpointError(f"{repo_id}: cannot reach the Hugging Face Hub and it is not in the local cache "
                          "(pass a local directory, or check the network)") from None
  except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError) as e:
    raise CheckpointError(f"{path}: not found on the Hugging Face Hub ({type(e).__name__}); a gated or private "
                          "model needs `huggingface-cli login`") from None
  except (hub_errors.HfHubHTTPError, OSError) as e:
    raise CheckpointError(f"{repo_id}: download failed: {' '.join(str(e).split())[:200]}") from None


__all__ = ["ALLOW_PATTERNS", "hub_offline", "resolve_model_path"]
