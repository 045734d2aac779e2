"""A vLLM worker extension for the tests: a "weight sync" that reads a safetensors folder.

It exercises the rollout side of the weightsync contract (method names and keyword arguments over
``collective_rpc``, the CPU backend's ``reload_weights`` and the prefix-cache reset) without
rlhf-weightsync, which rlhf-rollout must not import. The real transports are tested there.
"""


class FileWeightExtension:
    def init_weight_sync(
        self, *, transport, master_addr, master_port, rank_offset, world_size, timeout_s=60.0
    ):
        if transport != "file":
            raise ValueError(f"FileWeightExtension only knows transport 'file', got {transport!r}")
        self._sync_dir = master_addr
        self._sync_rank = rank_offset
        self._version = 0

    def receive_weights(self, *, timeout_s=None):
        self.reload_weights(weights_path=self._sync_dir)
        self._version += 1
        return {"version": self._version, "rank": self._sync_rank}

    def close_weight_sync(self):
        self._sync_dir = None
