"""KV transfer backends behind one interface (base.py): local (shm / CUDA IPC) and nixl."""

from pdlab.runtime.disagg.transfer.base import (KVLayout, KVLayoutMismatch, KVTransferBackend, KVTransferError,
                                               TransferStatus, TransferTimeout, create_transfer)

__all__ = ["KVLayout", "KVLayoutMismatch", "KVTransferBackend", "KVTransferError", "TransferStatus",
           "TransferTimeout", "create_transfer"]
