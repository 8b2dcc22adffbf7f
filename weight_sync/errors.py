"""Errors of the weight-sync channel, each carrying the HTTP status the server maps it to.

    try:
        receiver.begin(version, "shm", manifest)
    except UpdateConflict as e:   # e.http_status == 409
        ...

`ManifestError` (400, also a ValueError) : the manifest or a bucket does not match the model.
`UpdateConflict` (409)                    : stale version, an update already running, no update.
`NotOwner` (409, an UpdateConflict)       : the call names another run than the one owning the update.
`UpdateFailed` (400)                      : bad data: truncated bucket, checksum mismatch, ...
`NonFiniteWeights` (400)                  : the update holds NaN/inf values; nothing was applied.
`ServerRestarted`                         : (sender side) the server forgot the update it was committing:
                                            it restarted; push the version again once it is back.
`WeightSyncError`                         : base class; the sender raises it for any failed push.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, the step and the problem."""

    http_status = 400


class ManifestError(WeightSyncError, ValueError):
    """The manifest is malformed or does not match the served model (HTTP 400)."""

    http_status = 400


class UpdateConflict(WeightSyncError):
    """The request conflicts with the receiver's state: version, concurrency (HTTP 409)."""

    http_status = 409


class NotOwner(UpdateConflict):
    """The call names a run (run_id) other than the one that began the update (HTTP 409, names the owner)."""

    def __init__(self, version: int, owner: str, caller: str):
        super().__init__(f"run_id: update {version} belongs to run {owner!r}, not to run {caller!r}; "
                         "only the run that began an update may send its data, commit or abort it")
        self.version, self.owner, self.caller = version, owner, caller


class UpdateFailed(WeightSyncError):
    """The data of an update is incomplete or corrupt; the update was aborted (HTTP 400)."""

    http_status = 400


class NonFiniteWeights(UpdateFailed):
    """The staged weights contain NaN or infinite values; the update was refused (HTTP 400)."""


class ServerRestarted(WeightSyncError):
    """The server no longer knows the update being committed (it answers `unknown`): it restarted
    during the commit and lost the staged version. Nothing of it was applied; push it again."""

    def __init__(self, url: str, version: int, served_version: int):
        super().__init__(f"{url}: restarted during the commit of version {version} (it now serves version "
                         f"{served_version} and has no update {version}): nothing was applied")
        self.url, self.version, self.served_version = url, version, served_version
