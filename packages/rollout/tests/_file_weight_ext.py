"""A vLLM worker extension for the tests: a "weight sync" that reads a safetensors folder.

It exercises the rollout side of the weightsync contract (method names and keyword arguments over
``collective_rpc``, the report it returns, the CPU backend's ``reload_weights`` and the prefix-cache
reset) without rlhf-weightsync, which rlhf-rollout must not import. The real transports are tested
there.
"""

import time
from pathlib import Path


class FileWeightExtension:
    def init_weight_sync(
        self, *, transport, master_addr, master_port, rank_offset, world_size, timeout_s=60.0
    ):
        if transport != "file":
            raise ValueError(f"FileWeightExtension only knows transport 'file', got {transport!r}")
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset {rank_offset} is not a receiver rank of a group of {world_size}")
        self._sync_dir = master_addr
        self._version = 0

    def receive_weights(self, *, timeout_s=None):
        """The folder's safetensors files reloaded, reported as a ``WeightSyncReport`` (one bucket per file)."""
        start = time.perf_counter()
        self.reload_weights(weights_path=self._sync_dir)
        self._version += 1
        files = sorted(Path(self._sync_dir).glob("*.safetensors"))
        return {
            "version": self._version,
            "num_tensors": 0,
            "num_names": 0,
            "num_buckets": len(files),
            "num_bytes": sum(f.stat().st_size for f in files),
            "seconds": time.perf_counter() - start,
        }

    def close_weight_sync(self):
        self._sync_dir = None
