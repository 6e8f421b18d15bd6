"""Each step's inputs, from rank 0 to the tensor-parallel workers, as two tensor broadcasts.

Rank 0 schedules; the workers only need the flat batch it built. A step goes over the
control group (gloo, CPU) as a fixed-size int64 header (command and lengths), then one int64
payload holding the batch's arrays end to end. No Python object is pickled per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

_HEADER_LEN = 8
_STEP, _SHUTDOWN = 1, 2


@dataclass
class StepInputs:
    """One step's flat batch on the host: T tokens of B sequences, S of them sampled."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [S + R]: the rows whose logits are sampled, then R prompt-logprob rows
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    num_prompt_rows: int = 0  # R: the last R logits_indices score prompt tokens (engine/prompt_logprobs.py)


class StepChannel:
    """Rank 0 calls send() before each forward and shutdown() once; workers call recv()."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._header = torch.zeros(_HEADER_LEN, dtype=torch.int64)

    def send(self, inputs: StepInputs) -> None:
        b, width = inputs.block_tables.shape
        self._header[:6] = torch.tensor([_STEP, len(inputs.input_ids), b, width, len(inputs.logits_indices),
                                         inputs.num_prompt_rows])
        payload = np.concatenate([inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                                  inputs.query_start_loc, inputs.seq_lens, inputs.block_tables.ravel()],
                                 dtype=np.int64)
        dist.broadcast(self._header, 0, group=self.group)
        dist.broadcast(torch.from_numpy(payload), 0, group=self.group)

    def shutdown(self) -> None:
        self._header.zero_()
        self._header[0] = _SHUTDOWN
        dist.broadcast(self._header, 0, group=self.group)

    def recv(self) -> StepInputs | None:
        """The next step's inputs; None when rank 0 shuts the group down."""
        dist.broadcast(self._header, 0, group=self.group)
        command, t, b, width, s, r = self._header[:6].tolist()
        if command == _SHUTDOWN:
            return None
        payload = torch.empty(3 * t + s + 2 * b + 1 + b * width, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        ids, positions, slots, logits, qsl, seq_lens, tables = np.split(
            payload.numpy(), np.cumsum([t, t, t, s, b + 1, b]))
        return StepInputs(ids, positions, slots, logits, qsl.astype(np.int32), seq_lens.astype(np.int32),
                          tables.astype(np.int32).reshape(b, width), r)
