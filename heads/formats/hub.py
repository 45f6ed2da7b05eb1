"""Publish an export folder to the Hugging Face Hub.

The token comes from the environment (HF_TOKEN) or the user's `hf auth login`; it is handed to the client in
memory only, never written to disk or printed. HF_ENDPOINT points the client at another Hub (tests use a
local one).
"""

from __future__ import annotations

from pathlib import Path

from headway.heads.formats.common import ExportError


def check_repo_id(repo_id: str | None) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id or repo_id.count("/") != 1:
        raise ExportError(f"repo_id={repo_id!r} is not of the form ORG/NAME: pass e.g. repo_id=my-org/my-head")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportError(f"repo_id={repo_id!r} is not a valid Hub repo id ({first})") from None
    return repo_id


def hub_token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ExportError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again")
    return token


def push_folder(folder: Path, repo_id: str, private: bool = False, commit_message: str | None = None) -> str:
    """create_repo(exist_ok=True) + upload_folder; returns the repo URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id = check_repo_id(repo_id)
    token = hub_token()
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message=commit_message or f"Upload {Path(folder).name} exported by headway")
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = {401: "the token is invalid or expired", 403: "the token cannot write to this namespace",
                404: "the namespace does not exist"}.get(status, "see the Hub's message")
        raise ExportError(f"pushing to {repo_id} failed (HTTP {status}: {hint})") from None
    return str(url)
