"""Typed errors of the KV-transfer layer. Each message names the field and the fix."""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of every error raised by `beamserve.kv_transfer`."""


class ModelConfigError(KVTransferError, ValueError):
    """A checkpoint's `config.json` is missing a field or holds an invalid value."""


class TopologyError(KVTransferError, ValueError):
    """A pool topology (TP size, page size, KV dtype, layout) is invalid for the model."""


class TransferPlanError(KVTransferError, ValueError):
    """A prefill/decode pair, or a request's page tables, cannot be planned."""


class IncompatiblePeerError(KVTransferError):
    """The handshake found a peer whose KV cannot be read into ours (refused before any I/O)."""


class TransferFailedError(KVTransferError):
    """The backend reported a failed transfer."""


class TransferTimeoutError(TransferFailedError):
    """A transfer missed its deadline; it was cancelled and its resources released."""


class PeerLostError(TransferFailedError):
    """The peer process died or disconnected before the transfer completed."""


class ChecksumMismatchError(TransferFailedError):
    """End-to-end verification found destination bytes that differ from the source."""


class LeaseExpiredError(KVTransferError):
    """The prefill side no longer holds the request's KV (lease expired or released)."""


class LeaseNotFoundError(LeaseExpiredError):
    """The prefill side never published this request's KV (yet): the SGLang-style decode leg
    may arrive before its prefill leg, so a caller may wait and ask again (HTTP 404)."""
